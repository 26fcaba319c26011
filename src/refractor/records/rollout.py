"""Rollout-side records: a prompt drawn from the stream (``PromptRef``), a sample's trajectory
(``Rollout``, or ``EvalRollout`` for an eval completion) and a prompt's ``Group``.

Policy versions: version ``v`` means "the weights after ``v`` trainer steps" (0 = the base model).
The orchestrator orders every weight update, so it knows which version the servers hold at any
moment; each turn records the version when its generation started and when it ended. Staleness is
then measured, not inferred: ``off_policy_steps`` = updates that landed between the first turn's
start and the end of generation (every turn and environment response in between counted), or
until cancellation for a cancelled rollout.

Token layout of a finished rollout (alignment convention in :mod:`refractor.records.training`):
``prompt_ids`` = turn-0 prompt; ``completion_ids`` = turn-0 completion, then for each later turn
the new prompt tokens (env response + template glue; mask 0, logprob 0.0) followed by that turn's
completion (mask 1, engine logprobs). When a chat template is not append-only the later turns'
prompts are re-rendered and do not extend the running sequence; the rollout is then marked
``retokenized`` and :func:`to_train_samples` emits one exact sample per turn instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from refractor.records.training import TrainSample


@dataclass(frozen=True)
class PromptRef:
    """A prompt drawn from the prompt stream: its environment and dataset index."""

    env_name: str
    index: int
    ordinal: int = -1  # position in the prompt stream (-1: not drawn from a stream)


class RolloutStatus(StrEnum):
    IN_FLIGHT = "in_flight"
    KEPT = "kept"
    DISCARDED = "discarded"
    CANCELLED = "cancelled"
    EVAL = "eval"
    # written by an attempt of the run that died before the step was checkpointed; the resumed
    # run redoes that step, so these rows are history, not what any step trained on
    ABANDONED = "abandoned"


class DiscardReason(StrEnum):
    """Why a rollout did not reach the trainer. Values are the names shown in metrics and the store."""

    PROMPT_TOO_LONG = "prompt_too_long"
    GENERATION_ERROR = "generation_error"
    ENV_ERROR = "env_error"
    REWARD_ERROR = "reward_error"
    REWARD_TIMEOUT = "reward_timeout"
    GROUP_MEMBER_FAILED = "group_member_failed"
    MAX_ASYNC = "max_async"
    ZERO_ADVANTAGE = "zero_advantage"
    # cancellation reasons
    OFF_POLICY = "off_policy"
    SHUTDOWN = "shutdown"
    # deterministic_rollouts: past a batch's cut and the next batch needs newer weights; the prompt
    # goes back to the stream and runs again (same ordinal, same seeds)
    REQUEUED = "requeued"
    # its server died or hung and is being restarted; the prompt goes back to the stream
    SERVER_RESTART = "server_restart"


@dataclass
class ToolCall:
    tool_name: str
    arguments: str = ""
    result: str = ""
    success: bool = True
    error: str = ""
    raw: dict[str, Any] = field(default_factory=dict)  # every other field the environment reported


@dataclass
class Turn:
    """One model call plus the environment's answer to it (if any)."""

    index: int
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    completion_text: str = ""
    start_version: int = 0
    end_version: int = 0
    # what the server reported (token spans per weight version), when it reports it
    server_weight_versions: list[Any] = field(default_factory=list)
    max_tokens: int = 0
    start_time: float = 0.0
    end_time: float = 0.0
    # environment response that followed this turn (empty for the last turn)
    env_messages: list[dict[str, Any]] = field(default_factory=list)
    env_time: float = 0.0
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Rollout:
    """One sample's trajectory, from dispatch to its final status."""

    rollout_id: int
    group_id: int
    sample_idx: int  # index within the group
    env_name: str
    prompt_index: int = -1  # the prompt's index in its environment's dataset
    prompt_ordinal: int = -1  # the prompt's position in the prompt stream (seeds, replay on resume)
    prompt_text: str = ""
    system_prompt: str = ""
    turns: list[Turn] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # aligned with completion_ids
    logprobs: list[float] = field(default_factory=list)  # aligned with completion_ids
    retokenized: bool = False
    first_start_version: int | None = None  # version when the first turn started generating
    off_policy_steps: int = 0  # updates that landed during generation (or until cancellation)
    stop_reason: str = ""
    reward: float = 0.0
    sample_metrics: dict[str, float] = field(default_factory=dict)
    golden_answers: dict[str, Any] = field(default_factory=dict)
    advantage: float = 0.0
    status: RolloutStatus = RolloutStatus.IN_FLIGHT
    reason: str = ""
    error: str = ""
    server: str = ""
    lane: int = -1
    dispatch_time: float = 0.0
    generation_end_time: float = 0.0
    reward_time: float = 0.0  # seconds spent scoring
    finish_time: float = 0.0

    # --- derived views ---
    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def start_version(self) -> int | None:
        return self.first_start_version

    @property
    def end_version(self) -> int | None:
        return self.turns[-1].end_version if self.turns else None

    @property
    def completion_text(self) -> str:
        return "\n".join(t.completion_text for t in self.turns)

    @property
    def num_completion_tokens(self) -> int:
        """Tokens the policy sampled (all turns; env tokens excluded)."""
        return sum(len(t.completion_ids) for t in self.turns)

    @property
    def is_truncated(self) -> bool:
        return self.stop_reason in ("length", "context_exhausted")

    def mark(self, status: RolloutStatus, reason: str = "", error: str = "") -> None:
        self.status = status
        self.reason = str(reason)
        if error:
            self.error = error


@dataclass
class EvalRollout(Rollout):
    """An eval completion's row: status ``eval``, stored under the eval step instead of a training step."""

    step: int = 0  # reported eval step (1-indexed; the baseline is 0)


@dataclass
class Group:
    """``group_size`` rollouts of one prompt; advantages are computed over the group."""

    group_id: int
    env_name: str
    prompt_key: tuple[str, int]  # (environment, dataset index): what the prompt stream replays on resume
    rollouts: list[Rollout]
    ordinal: int = -1  # the prompt's position in the prompt stream (seeds, deterministic batch order)
    server: str = ""
    dispatch_version: int = 0  # version loaded when the group was created
    completion_version: int = 0  # version loaded when its last rollout finished
    step: int = -1  # training step whose batch took it (kept groups)
    status: RolloutStatus = RolloutStatus.IN_FLIGHT
    reason: str = ""

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]

    @property
    def advantages(self) -> list[float]:
        return [r.advantage for r in self.rollouts]

    @property
    def prompt_ref(self) -> PromptRef:
        return PromptRef(self.prompt_key[0], self.prompt_key[1], self.ordinal)

    def mark(self, status: RolloutStatus, reason: str = "") -> None:
        """Set the group's final status on every member (a member's own discard reason is kept)."""
        self.status = status
        self.reason = str(reason)
        for r in self.rollouts:
            if status == RolloutStatus.DISCARDED and r.status == RolloutStatus.DISCARDED and r.reason:
                continue
            r.mark(status, reason)


def append_turn_tokens(rollout: Rollout, turn: Turn) -> None:
    """Extend the rollout's interleaved sequence with one finished turn.

    Turn 0 sets the prompt. A later turn's prompt must extend the running sequence (prompt +
    completion so far); the new tokens are env/template tokens (mask 0). If it does not extend
    it (a template that rewrites history), the rollout is marked ``retokenized``.
    """
    if turn.index == 0:
        rollout.prompt_ids = list(turn.prompt_ids)
    else:
        running = rollout.prompt_ids + rollout.completion_ids
        if turn.prompt_ids[: len(running)] == running:
            glue = turn.prompt_ids[len(running) :]
            rollout.completion_ids += glue
            rollout.loss_mask += [0] * len(glue)
            rollout.logprobs += [0.0] * len(glue)
        else:
            rollout.retokenized = True
    if len(turn.logprobs) != len(turn.completion_ids):
        raise ValueError(
            f"rollout {rollout.rollout_id} turn {turn.index}: {len(turn.completion_ids)} tokens but "
            f"{len(turn.logprobs)} logprobs from the server"
        )
    rollout.completion_ids += turn.completion_ids
    rollout.loss_mask += [1] * len(turn.completion_ids)
    rollout.logprobs += list(turn.logprobs)


def to_train_samples(rollout: Rollout, sample_id: int | None = None) -> list[TrainSample]:
    """Convert a kept rollout into trainer samples (alignment as in :mod:`refractor.records.training`).

    Normally one sample: prompt (mask 0) + interleaved completion. A ``retokenized`` rollout gives
    one sample per turn, each exactly what the engine saw for that call, so no token is trained
    on that the policy did not sample in that context.
    """
    sid = rollout.rollout_id if sample_id is None else sample_id
    if not rollout.retokenized:
        n_prompt = len(rollout.prompt_ids)
        return [
            TrainSample(
                input_ids=rollout.prompt_ids + rollout.completion_ids,
                loss_mask=[0] * n_prompt + list(rollout.loss_mask),
                advantage=rollout.advantage,
                rollout_logprobs=[0.0] * n_prompt + list(rollout.logprobs),
                sample_id=sid,
            )
        ]
    return [
        TrainSample(
            input_ids=t.prompt_ids + t.completion_ids,
            loss_mask=[0] * len(t.prompt_ids) + [1] * len(t.completion_ids),
            advantage=rollout.advantage,
            rollout_logprobs=[0.0] * len(t.prompt_ids) + list(t.logprobs),
            sample_id=sid,
        )
        for t in rollout.turns
        if t.completion_ids
    ]
