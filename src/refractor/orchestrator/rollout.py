"""One sample, start to finish: turns of generation and environment, then its reward.

The same loop runs single- and multi-turn environments (single-turn = one turn), so truncation
flags, stop reasons and token layout cannot diverge between modes. Generation goes through any
object with ``async generate(token_ids, sampling)`` (a real client, or a fake server in tests).
The reward is computed with the environments package's ``score_rollout`` (timeout, failures
recorded, blocking work off the event loop); a failure discards the rollout with its reason.

Sampling seeds (``deterministic_rollouts``): each request's seed is a hash of the run seed, the
prompt's stream ordinal, the sample's index in its group and the turn index, so a group that runs
again (requeued, or replayed after a resume) draws exactly the same tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from refractor.envs.base import Environment, strip_eos
from refractor.envs.scoring import score_rollout
from refractor.inference.client import Sampling
from refractor.orchestrator.chat import ChatTokens
from refractor.orchestrator.lifecycle import RolloutEvents
from refractor.records import (
    DiscardReason,
    Rollout,
    RolloutState,
    RolloutStatus,
    Sample,
    ToolCall,
    ToolCallRecord,
    TrajectoryStep,
    Turn,
    append_turn_tokens,
)


class GenerateResult(Protocol):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_versions: Any
    latency: dict[str, float]
    server_request_id: str | None


class InferenceServer(Protocol):
    """What the rollout loop needs from a server: a name and token-in/token-out generation."""

    name: str

    async def generate(
        self, token_ids: list[int], sampling: Sampling, *, priority: int = 0
    ) -> GenerateResult:
        """``priority``: lower is served first (later turns get lower values)."""


@dataclass
class PreparedPrompt:
    """A prompt ready to dispatch (built off the event loop by the prefetcher)."""

    env_name: str
    index: int
    sample: Sample
    messages: list[dict[str, Any]]
    prompt_ids: list[int]
    prompt_text: str = ""
    system_prompt: str = ""
    ordinal: int = -1  # position in the prompt stream


def prepare_prompt(env: Environment, index: int, chat: ChatTokens, ordinal: int = -1) -> PreparedPrompt:
    sample = env.get_sample(index)
    messages = env.get_initial_prompt(sample, chat.tokenizer)
    user = next((m for m in messages if m.get("role") == "user"), {})
    system = next((m for m in messages if m.get("role") == "system"), {})
    return PreparedPrompt(
        env.name,
        index,
        sample,
        messages,
        chat.render(messages),
        str(user.get("content", "")),
        str(system.get("content", "")),
        ordinal,
    )


def sampling_seed(run_seed: int, ordinal: int, sample_idx: int, turn: int) -> int:
    """The seed of one generation request, in [0, 2**31): a hash, so nearby inputs give unrelated seeds.

    It depends only on where the prompt sits in the prompt stream, never on group/rollout ids or
    on timing, which change when a group runs again.
    """
    if ordinal < 0:
        raise ValueError(f"a sampling seed needs the prompt's stream ordinal, got {ordinal}")
    key = f"refractor-sampling:{run_seed}:{ordinal}:{sample_idx}:{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % (2**31)


class SerialServer:
    """Sends the wrapped server one generation request at a time (``serialize_generation``).

    Engines whose numerics depend on which requests share a batch (GEMM results change with the
    number of rows) then compute every request alone. A request whose caller is cancelled still
    runs to its end before the next one starts, so an abandoned request never shares the engine.
    Only ``generate`` is serialized; every other attribute is the wrapped server's.
    """

    def __init__(self, server: InferenceServer) -> None:
        self.server = server
        self.name = server.name
        self._turn = asyncio.Lock()

    def __getattr__(self, name: str) -> Any:
        if name == "server":  # not set yet (e.g. while copying): no recursion
            raise AttributeError(name)
        return getattr(self.server, name)

    async def generate(
        self, token_ids: list[int], sampling: Sampling, *, priority: int = 0
    ) -> GenerateResult:
        await self._turn.acquire()
        try:
            request = asyncio.ensure_future(self.server.generate(token_ids, sampling, priority=priority))
        except BaseException:
            self._turn.release()
            raise
        request.add_done_callback(self._finished)
        return await asyncio.shield(request)

    def _finished(self, request: asyncio.Future) -> None:
        self._turn.release()
        if not request.cancelled():
            # retrieved here, so an abandoned request's error is not reported as unhandled
            request.exception()


@dataclass
class RolloutSettings:
    max_tokens: int
    max_model_len: int
    temperature: float = 1.0
    top_p: float | None = None
    interleaved: bool = True
    reward_timeout_s: float = 120.0
    eos_token: str = ""
    seed: int | None = None  # run seed; set: every request carries its sampling_seed()
    # vllm_scheduling_policy priority: a rollout's later turns go before waiting requests (-turn);
    # fcfs: every request has priority 0, so both engines serve in arrival order
    later_turns_first: bool = True

    @classmethod
    def from_config(cls, cfg: Any, eos_token: str) -> RolloutSettings:
        return cls(
            max_tokens=cfg.max_tokens,
            max_model_len=cfg.max_model_len,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            interleaved=cfg.interleaved_rollouts,
            reward_timeout_s=cfg.reward_timeout_s,
            eos_token=eos_token,
            seed=cfg.seed if cfg.deterministic_rollouts else None,
            later_turns_first=cfg.vllm_scheduling_policy == "priority",
        )


@dataclass
class SampleHooks:
    """Callbacks into the orchestrator (all called on the event loop)."""

    current_version: Callable[[], int]
    clock: Callable[[], float]
    on_generation_end: Callable[[Rollout], None] = lambda r: None
    generating: set[int] = field(default_factory=set)  # rollout ids currently in their generation phase
    events: RolloutEvents | None = None  # the lifecycle spans; None: not recorded (evals)

    def span(self, name: str, rollout: Rollout, **attrs: Any) -> AbstractContextManager[dict[str, Any]]:
        if self.events is None:
            return nullcontext({})
        return self.events.span(name, **_rollout_attrs(rollout), **attrs)


def _rollout_attrs(rollout: Rollout) -> dict[str, Any]:
    return {"rollout_id": rollout.rollout_id, "group_id": rollout.group_id, "sample": rollout.sample_idx}


async def run_rollout(
    rollout: Rollout,
    prompt: PreparedPrompt,
    env: Environment,
    server: InferenceServer,
    chat: ChatTokens,
    settings: RolloutSettings,
    hooks: SampleHooks,
) -> Rollout:
    """Generate every turn, then score. Fills ``rollout`` in place; never raises for user errors."""
    rollout.prompt_text = prompt.prompt_text
    rollout.system_prompt = prompt.system_prompt
    state = env.create_initial_state(prompt.sample)
    hooks.generating.add(rollout.rollout_id)
    try:
        await _generate_turns(SampleRun(rollout, prompt, state, env, server, chat, settings, hooks))
    finally:
        hooks.generating.discard(rollout.rollout_id)
        rollout.generation_end_time = hooks.clock()
    if rollout.first_start_version is not None:
        rollout.off_policy_steps = hooks.current_version() - rollout.first_start_version
    hooks.on_generation_end(rollout)
    if rollout.status == RolloutStatus.DISCARDED:
        return rollout
    with hooks.span("reward", rollout) as span:
        outcome = await score_rollout(
            env, state, eos_token=settings.eos_token, timeout_s=settings.reward_timeout_s
        )
        span["ok"] = outcome.ok
    rollout.reward_time = outcome.elapsed_s
    if not outcome.ok:
        rollout.mark(RolloutStatus.DISCARDED, outcome.reason, outcome.detail)
    else:
        result = outcome.result
        rollout.reward = float(result.total_reward)
        rollout.sample_metrics = dict(result.sample_metrics)
        rollout.golden_answers = dict(result.golden_answers)
    rollout.finish_time = hooks.clock()
    return rollout


@dataclass
class SampleRun:
    """Everything the turns of one sample share."""

    rollout: Rollout
    prompt: PreparedPrompt
    state: RolloutState
    env: Environment
    server: InferenceServer
    chat: ChatTokens
    settings: RolloutSettings
    hooks: SampleHooks


def _record_tool_spans(hooks: SampleHooks, rollout: Rollout, turn: int, calls: list[ToolCallRecord]) -> None:
    """``tool_execution`` spans of the tool calls that an environment timed."""
    if hooks.events is None:
        return
    for i, c in enumerate(calls):
        if c.started_at is not None and c.ended_at is not None:
            hooks.events.add(
                "tool_execution",
                c.started_at,
                c.ended_at,
                **_rollout_attrs(rollout),
                turn=turn,
                tool_call=i,
                tool=c.tool_name,
                success=c.success,
            )


async def _generate_turns(run: SampleRun) -> None:
    rollout = run.rollout
    state = run.state
    env = run.env
    server = run.server
    chat = run.chat
    settings = run.settings
    hooks = run.hooks
    messages = list(run.prompt.messages)
    prompt_ids = list(run.prompt.prompt_ids)
    base = Sampling(
        max_tokens=settings.max_tokens, temperature=settings.temperature, top_p=settings.top_p or 1.0
    )
    index = 0
    while True:
        budget = min(settings.max_tokens, settings.max_model_len - len(prompt_ids))
        if budget <= 0:
            if index == 0:
                rollout.mark(
                    RolloutStatus.DISCARDED,
                    DiscardReason.PROMPT_TOO_LONG,
                    f"prompt of {len(prompt_ids)} tokens leaves no room below max_model_len "
                    f"{settings.max_model_len}",
                )
            else:
                rollout.stop_reason = "context_exhausted"
            return
        turn = Turn(
            index,
            prompt_ids,
            max_tokens=budget,
            start_version=hooks.current_version(),
            start_time=hooks.clock(),
        )
        if index == 0:
            rollout.first_start_version = turn.start_version
        try:
            seed = (
                None
                if settings.seed is None
                else sampling_seed(settings.seed, run.prompt.ordinal, rollout.sample_idx, index)
            )
            with hooks.span("generation", rollout, turn=index, server=server.name, lane=rollout.lane) as span:
                result = await server.generate(
                    prompt_ids,
                    replace(base, max_tokens=budget, seed=seed),
                    priority=-index if settings.later_turns_first else 0,
                )
                span.update(finish_reason=result.finish_reason, completion_tokens=len(result.token_ids))
                if result.server_request_id is not None:
                    span["request_id"] = result.server_request_id
                span.update(result.latency)  # the server's account (docs/metrics.md#latency)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            rollout.mark(
                RolloutStatus.DISCARDED,
                DiscardReason.GENERATION_ERROR,
                f"server {server.name}: {type(err).__name__}: {err}"[:2000],
            )
            return
        turn.end_version = hooks.current_version()
        turn.end_time = hooks.clock()
        if result.finish_reason == "abort":  # the server dropped the request (restart, abort route)
            rollout.mark(
                RolloutStatus.DISCARDED,
                DiscardReason.GENERATION_ERROR,
                f"server {server.name} aborted the request",
            )
            return
        turn.completion_ids = list(result.token_ids)
        turn.logprobs = list(result.logprobs)
        turn.finish_reason = str(result.finish_reason or "")
        turn.server_weight_versions = list(result.weight_versions or [])
        turn.completion_text = strip_eos(chat.decode(turn.completion_ids), settings.eos_token)
        assistant = {"role": "assistant", "content": turn.completion_text}
        state.add_step(
            TrajectoryStep(
                prompt=list(messages),
                completion=[assistant],
                prompt_token_ids=list(prompt_ids),
                completion_token_ids=list(turn.completion_ids),
                completion_logprobs=list(turn.logprobs),
                is_truncated=turn.finish_reason == "length",
                finish_reason=turn.finish_reason,
            )
        )
        rollout.turns.append(turn)
        try:
            append_turn_tokens(rollout, turn)
        except ValueError as err:
            rollout.mark(RolloutStatus.DISCARDED, DiscardReason.GENERATION_ERROR, str(err))
            return
        try:
            env_start = hooks.clock()
            with hooks.span("env_response", rollout, turn=index):
                env_msgs = await env.env_response([*messages, assistant], state)
            turn.env_time = hooks.clock() - env_start
            done, reason = env.is_done(state)
            executed = state.pop_pending_tool_calls()
            _record_tool_spans(hooks, rollout, index, executed)
            turn.tool_calls = [
                ToolCall(
                    c.tool_name,
                    c.arguments,
                    c.result,
                    c.success,
                    c.error or "",
                    {
                        "raw_text": c.raw_text,
                        "exit_code": c.exit_code,
                        "truncated": c.truncated,
                        "result_tokens": c.result_tokens,
                        "sandbox_id": c.sandbox_id,
                        "started_at": c.started_at,
                        "ended_at": c.ended_at,
                    },
                )
                for c in executed
            ]
            if done:
                if turn.finish_reason == "length" or not env.is_multi_turn:
                    rollout.stop_reason = turn.finish_reason or "stop"
                else:
                    rollout.stop_reason = reason or "done"
                return
            turn.env_messages = list(env_msgs or [])
            messages = env.get_next_prompt_messages(state, turn.env_messages)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            rollout.mark(
                RolloutStatus.DISCARDED,
                DiscardReason.ENV_ERROR,
                f"environment {env.name}: {type(err).__name__}: {err}"[:2000],
            )
            return
        running = [*prompt_ids, *turn.completion_ids]
        next_ids = (
            chat.next_turn_ids(running, turn.completion_ids, turn.env_messages)
            if settings.interleaved
            else None
        )
        prompt_ids = next_ids if next_ids is not None else chat.render(messages)
        index += 1
