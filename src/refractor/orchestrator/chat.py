"""Token-exact prompts: render the first turn, then extend the running token sequence.

Interleaving (``interleaved_rollouts``): the next turn's prompt is the previous turn's prompt and
completion tokens *exactly as the engine saw and sampled them*, plus the template's end-of-turn
glue (minus what the model already emitted, e.g. its ``<|im_end|>``), plus the rendered
environment messages and the next assistant header. Those last two are obtained from the chat
template itself as a text delta: ``render(probe + env, gen=True)`` minus ``render(probe)``.

A template that is not append-only (the delta is not a suffix, e.g. it rewrites earlier turns)
makes interleaving impossible; the whole conversation is then re-rendered and the rollout is
marked ``retokenized`` (see :mod:`refractor.records.rollout`).
"""

from __future__ import annotations

from typing import Any

_PROBE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "I am a user."},
    {"role": "assistant", "content": "World!"},
]


def _clean(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k != "turn_type"} for m in messages]


class ChatTokens:
    """Chat-template rendering to token ids, and the interleaved next-turn prompt."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        probe_text = self._render_text(_PROBE, add_generation_prompt=False)
        end = probe_text.rfind("World!")
        if end < 0:  # a template that drops assistant content cannot be interleaved at all
            self.turn_suffix_ids: list[int] | None = None
        else:
            self.turn_suffix_ids = self.encode(probe_text[end + len("World!") :])
        self._probe_text = probe_text

    # --- plain rendering ---
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _render_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            _clean(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **self.kwargs
        )

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """Full prompt for ``messages`` (a trailing assistant message is continued, not closed)."""
        continue_final = bool(messages) and messages[-1].get("role") == "assistant"
        text = self.tokenizer.apply_chat_template(
            _clean(messages),
            tokenize=False,
            add_generation_prompt=not continue_final,
            continue_final_message=continue_final,
            **self.kwargs,
        )
        return self.encode(text)

    # --- interleaving ---
    def env_delta_ids(self, env_messages: list[dict[str, Any]]) -> list[int] | None:
        """Tokens the template appends for ``env_messages`` + the next assistant header, or None."""
        full = self._render_text([*_PROBE, *env_messages], add_generation_prompt=True)
        if not full.startswith(self._probe_text):
            return None
        return self.encode(full[len(self._probe_text) :])

    def next_turn_ids(
        self, running_ids: list[int], completion_ids: list[int], env_messages: list[dict[str, Any]]
    ) -> list[int] | None:
        """``running_ids`` (prompt + completion of the last turn) extended for the next turn, or None
        when the template cannot be interleaved (the caller re-renders)."""
        if self.turn_suffix_ids is None:
            return None
        delta = self.env_delta_ids(env_messages)
        if delta is None:
            return None
        suffix = self.turn_suffix_ids
        overlap = 0  # the model may already have emitted the start of the end-of-turn glue
        for k in range(min(len(suffix), len(completion_ids)), 0, -1):
            if completion_ids[-k:] == suffix[:k]:
                overlap = k
                break
        return [*running_ids, *suffix[overlap:], *delta]


def run_chat_tokens(tokenizer: Any, enable_thinking: bool) -> ChatTokens:
    """The renderer a run uses for training and eval prompts (``enable_thinking`` goes to the template)."""
    return ChatTokens(tokenizer, {"enable_thinking": True} if enable_thinking else None)
