"""Environment-facing records: samples, trajectories, reward results, tool calls.

Field names are those Telescope environments use, so user environments run unchanged
(docs/data-path.md#sample). Chat messages stay plain dicts (``{"role", "content", "turn_type"?}``)
because user code builds them literally.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ChatMessage = dict[str, Any]
Messages = list[ChatMessage]

# Framework keys in RolloutState.custom (Telescope's names, so user environments run unchanged;
# docs/data-path.md#sample).
PENDING_TOOL_CALLS = "_pending_tool_calls"


@dataclass
class Sample:
    """One dataset item. ``prompt`` is a question string or a ready message list."""

    prompt: str | list[ChatMessage]
    answer: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


def info_turn(
    key: str, value: Any, info_type: str = "text", turn_order: int = 0, **extra: Any
) -> dict[str, Any]:
    """One ``info_turns`` row: extra text shown next to a rollout (code, stderr, test summaries...)."""
    return {"turn_order": turn_order, "info_key": key, "info_value": value, "info_type": info_type, **extra}


@dataclass
class RewardResult:
    """What scoring one rollout produces. ``sample_metrics`` are per-rollout numbers (logged)."""

    total_reward: float
    sample_metrics: dict[str, float] = field(default_factory=dict)
    golden_answers: dict[str, str | None] = field(default_factory=dict)
    info_turns: list[dict[str, Any]] = field(default_factory=list)
    sample_tags: dict[str, str] = field(default_factory=dict)


@dataclass
class EvalMetricsResult:
    """Eval scoring: metrics only (no training reward)."""

    metrics: dict[str, float] = field(default_factory=dict)
    golden_answers: dict[str, str | None] = field(default_factory=dict)
    info_turns: list[dict[str, Any]] = field(default_factory=list)
    sample_tags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_reward(cls, result: RewardResult) -> EvalMetricsResult:
        return cls(
            dict(result.sample_metrics),
            dict(result.golden_answers),
            list(result.info_turns),
            dict(result.sample_tags),
        )


@dataclass
class TrajectoryStep:
    """One model call: the messages it saw, what it answered, and the exact tokens."""

    prompt: Messages
    completion: Messages
    prompt_token_ids: list[int] = field(default_factory=list)
    completion_token_ids: list[int] = field(default_factory=list)
    completion_logprobs: list[float] = field(default_factory=list)
    is_truncated: bool = False
    finish_reason: str | None = None  # refractor addition: the engine's finish reason ("stop", "length")

    @property
    def completion_text(self) -> str:
        return "".join(str(m.get("content") or "") for m in self.completion)


@dataclass
class ToolCallRecord:
    """One executed tool call, as logged (the keys of ``_pending_tool_calls`` entries;
    docs/data-path.md#sample)."""

    tool_name: str
    arguments: str = "{}"  # JSON text
    raw_text: str = ""
    result: str = ""
    success: bool = True
    error: str | None = None
    exit_code: int | None = None
    truncated: bool = False
    result_tokens: int | None = None
    sandbox_id: str | None = None
    started_at: float | None = None  # unix seconds the call ran (the environment's clock), if timed
    ended_at: float | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ToolCallRecord:
        args = d.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, default=str)
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k != "arguments"}
        known.setdefault("tool_name", str(d.get("tool_name", "")))
        return cls(arguments=args, **known)


@dataclass
class RolloutState:
    """A rollout in progress: the sample, every model call so far, and env-owned scratch space."""

    sample: Sample
    env_name: str = ""
    trajectory: list[TrajectoryStep] = field(default_factory=list)
    is_completed: bool = False
    stop_reason: str | None = None
    error: str | None = None
    custom: dict[str, Any] = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return len(self.trajectory)

    def add_step(self, step: TrajectoryStep) -> None:
        self.trajectory.append(step)

    @property
    def last_completion_text(self) -> str:
        return self.trajectory[-1].completion_text if self.trajectory else ""

    @property
    def completion_text(self) -> str:
        """All assistant turns joined by newlines (Telescope-compatible multi-turn completion text)."""
        return "\n".join(step.completion_text for step in self.trajectory)

    def get_completion_token_ids(self) -> list[int]:
        return [t for step in self.trajectory for t in step.completion_token_ids]

    def get_completion_logprobs(self) -> list[float]:
        return [lp for step in self.trajectory for lp in step.completion_logprobs]

    def pop_pending_tool_calls(self) -> list[ToolCallRecord]:
        """Take the tool calls the env exposed during the last ``env_response`` (and clear them)."""
        pending = self.custom.pop(PENDING_TOOL_CALLS, None) or []
        return [r if isinstance(r, ToolCallRecord) else ToolCallRecord.from_dict(r) for r in pending]
