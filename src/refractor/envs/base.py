"""Environment base classes (Telescope-compatible API, docs/config.md#telescope-compatibility) and
the one turn protocol the orchestrator drives (docs/architecture.md#seams).

Every environment, single- or multi-turn, is driven the same way (see ``refractor.envs``):
``create_initial_state`` -> ``get_initial_prompt`` -> [generate, ``env_response``, ``is_done``]* ->
``score``. A single-turn environment is a multi-turn one whose ``max_turns`` is 1, so the
orchestrator has one code path; only the reward signature differs (``score`` hides it).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from refractor.envs.runners import call_maybe_async
from refractor.records import (  # noqa: F401  (re-exported: `from ...base import Sample` works)
    ChatMessage,
    EvalMetricsResult,
    Messages,
    RewardResult,
    RolloutState,
    Sample,
    TrajectoryStep,
)

THINK_PREFIX = "<think>"


def _accepts(fn, name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class Environment(ABC):
    """Base of every environment. Subclasses implement ``load_dataset`` and ``compute_reward``.

    Plain ``Environment`` subclasses are single-turn with Telescope's signature
    ``compute_reward(completion, sample, eos_token="")`` (docs/config.md#telescope-compatibility).
    """

    eos_token: str = "<|endoftext|>"
    reward_min: float | None = None
    reward_max: float | None = None
    metrics_ranges: ClassVar[dict[str, dict[str, Any]]] = {}
    tags_options: ClassVar[dict[str, list[str]]] = {}
    is_multi_turn: bool = False
    max_turns: int = 1
    system_prompt: str | None = None
    # Built-ins set this: an unknown constructor kwarg is then an error instead of a silent attribute.
    strict_kwargs: ClassVar[bool] = False

    def __init__(
        self, eos_token: str | None = None, add_thinking_prefix: bool = False, **kwargs: Any
    ) -> None:
        if eos_token is not None:
            self.eos_token = eos_token
        self.add_thinking_prefix = add_thinking_prefix
        if self.strict_kwargs and kwargs:
            raise TypeError(
                f"{type(self).__name__} got unknown kwargs {sorted(kwargs)}; "
                f"accepted: {self.accepted_kwargs()}"
            )
        for key, value in kwargs.items():  # Telescope-compatible: extra kwargs become attributes
            setattr(self, key, value)
        self._samples: list[Sample] | None = None
        if not hasattr(self, "_name"):
            self._name: str | None = None

    @classmethod
    def accepted_kwargs(cls) -> list[str]:
        names: set[str] = set()
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is not None:
                names |= {p for p in inspect.signature(init).parameters if p not in ("self", "kwargs")}
        return sorted(names)

    # ----- identity and data -------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name or type(self).__name__

    @abstractmethod
    def load_dataset(self, num_samples: int = -1, **kwargs: Any) -> list[Sample]:
        """Load the samples, set ``self._samples`` and return them."""

    @property
    def samples(self) -> list[Sample]:
        if self._samples is None:
            self._samples = self.load_dataset()
        return self._samples

    def get_sample(self, idx: int) -> Sample:
        return self.samples[idx]

    def __len__(self) -> int:
        return len(self.samples)

    # ----- prompts -----------------------------------------------------------------------------
    def get_initial_prompt(self, sample: Sample, tokenizer: Any = None) -> Messages:
        """The first turn's messages: optional system + the sample's user content."""
        if isinstance(sample.prompt, list):
            messages = [dict(m) for m in sample.prompt]
        else:
            messages = [{"role": "user", "content": sample.prompt}]
        if self.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def render_prompt(
        self, messages: Messages, tokenizer: Any, chat_template_kwargs: dict | None = None
    ) -> str:
        """Apply the chat template. A trailing assistant message (thinking prefix) is continued."""
        continue_final = bool(messages) and messages[-1].get("role") == "assistant"
        clean = [{k: v for k, v in m.items() if k != "turn_type"} for m in messages]
        return tokenizer.apply_chat_template(
            clean,
            tokenize=False,
            add_generation_prompt=not continue_final,
            continue_final_message=continue_final,
            **(chat_template_kwargs or {}),
        )

    # ----- turn protocol -----------------------------------------------------------------------
    def create_initial_state(self, sample: Sample) -> RolloutState:
        return RolloutState(sample=sample, env_name=self.name)

    async def env_response(self, messages: Messages, state: RolloutState) -> Messages:
        """Messages to append after the model's turn. Single-turn: nothing (the episode ends)."""
        return []

    def is_done(self, state: RolloutState) -> tuple[bool, str | None]:
        if state.num_turns >= self.max_turns:
            return True, ("max_turns_reached" if self.is_multi_turn else "completed")
        return False, None

    def get_next_prompt_messages(self, state: RolloutState, env_msgs: Messages) -> Messages:
        last = state.trajectory[-1]
        return [*last.prompt, *last.completion, *env_msgs]

    # ----- rewards -----------------------------------------------------------------------------
    @abstractmethod
    async def compute_reward(self, *args: Any, **kwargs: Any) -> RewardResult:
        """Single-turn: ``(completion, sample, eos_token="")``; multi-turn: ``(state, eos_token="")``."""

    async def compute_eval_metrics(self, *args: Any, **kwargs: Any) -> EvalMetricsResult:
        """Eval scoring; the default reuses the training reward's sample metrics."""
        if "eos_token" in kwargs and not _accepts(self.compute_reward, "eos_token"):
            kwargs.pop("eos_token")
        result = await call_maybe_async(self.compute_reward, *args, **kwargs)
        return EvalMetricsResult.from_reward(result)

    def _reward_args(self, fn, state: RolloutState, eos_token: str) -> tuple[tuple, dict]:
        args = (state,) if self.is_multi_turn else (state.last_completion_text, state.sample)
        return args, ({"eos_token": eos_token or self.eos_token} if _accepts(fn, "eos_token") else {})

    async def score(self, state: RolloutState, eos_token: str = "") -> RewardResult:
        """Framework entry point: the training reward of a finished rollout, whatever the env type."""
        args, kwargs = self._reward_args(self.compute_reward, state, eos_token)
        return await call_maybe_async(self.compute_reward, *args, **kwargs)

    async def score_eval(self, state: RolloutState, eos_token: str = "") -> EvalMetricsResult:
        args, kwargs = self._reward_args(self.compute_eval_metrics, state, eos_token)
        return await call_maybe_async(self.compute_eval_metrics, *args, **kwargs)

    # ----- resources ---------------------------------------------------------------------------
    async def prepare_resources(self) -> None:  # noqa: B027 (optional hook)
        """Pre-warm expensive resources (sandbox pools...). Called once before rollouts."""

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Release resources (sandboxes, worker processes). Called once at shutdown; idempotent."""

    def describe(self) -> dict[str, Any]:
        """Summary for run metadata and the dashboard."""
        info: dict[str, Any] = {
            "name": self.name,
            "is_multi_turn": self.is_multi_turn,
            "dataset_size": len(self._samples) if self._samples is not None else None,
        }
        if self.is_multi_turn:
            info["max_turns"] = self.max_turns
        if self.reward_min is not None and self.reward_max is not None:
            info["reward_min"], info["reward_max"] = self.reward_min, self.reward_max
        if self.metrics_ranges:
            info["metrics_ranges"] = dict(self.metrics_ranges)
        if self.tags_options:
            info["tags_options"] = dict(self.tags_options)
        return info


class SingleTurnEnvironment(Environment):
    """One model answer per sample; user content = ``instruction_prompt + "\\n\\n" + question``."""

    def __init__(
        self, system_prompt: str | None = None, instruction_prompt: str | None = None, **kwargs: Any
    ) -> None:
        self.system_prompt = system_prompt
        self.instruction_prompt = instruction_prompt
        super().__init__(**kwargs)

    def user_content(self, question: str) -> str:
        return f"{self.instruction_prompt}\n\n{question}" if self.instruction_prompt else question

    def get_initial_prompt(self, sample: Sample, tokenizer: Any = None) -> Messages:
        if isinstance(sample.prompt, list):
            messages = super().get_initial_prompt(sample)
        else:
            messages = super().get_initial_prompt(Sample(self.user_content(sample.prompt), sample.answer))
        if self.add_thinking_prefix:
            messages.append({"role": "assistant", "content": THINK_PREFIX})
        return messages

    def format_prompt(
        self,
        question: str,
        tokenizer: Any,
        add_thinking_prefix: bool | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> str:
        """Telescope-compatible helper: the rendered first prompt for a question string."""
        thinking = self.add_thinking_prefix if add_thinking_prefix is None else add_thinking_prefix
        saved = self.add_thinking_prefix
        self.add_thinking_prefix = thinking
        try:
            messages = self.get_initial_prompt(Sample(question))
        finally:
            self.add_thinking_prefix = saved
        return self.render_prompt(messages, tokenizer, chat_template_kwargs)

    @abstractmethod
    async def compute_reward(self, completion: str, sample: Sample, eos_token: str = "") -> RewardResult: ...


class MultiTurnEnvironment(Environment):
    """Several model turns; ``env_response`` answers each, ``is_done`` ends the episode."""

    is_multi_turn = True

    def __init__(self, max_turns: int = 10, system_prompt: str | None = None, **kwargs: Any) -> None:
        if max_turns < 1:
            raise ValueError(f"{type(self).__name__}: max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.system_prompt = system_prompt
        super().__init__(**kwargs)

    async def env_response(self, messages: Messages, state: RolloutState) -> Messages:
        raise NotImplementedError(f"{type(self).__name__} must implement env_response(messages, state)")

    @abstractmethod
    async def compute_reward(self, state: RolloutState, eos_token: str = "") -> RewardResult: ...


def strip_eos(text: str, eos_token: str) -> str:
    """Drop a trailing end-of-sequence string (engines may return it as text)."""
    if eos_token and text.endswith(eos_token):
        return text[: -len(eos_token)]
    return text


__all__ = [
    "Environment",
    "SingleTurnEnvironment",
    "MultiTurnEnvironment",
    "Sample",
    "RewardResult",
    "EvalMetricsResult",
    "RolloutState",
    "TrajectoryStep",
    "ChatMessage",
    "Messages",
    "strip_eos",
    "call_maybe_async",
]
