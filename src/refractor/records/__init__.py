"""The typed records of the data path, in the order data flows through them.

``Sample`` (a dataset item, :mod:`.sample`) -> ``Rollout`` (one sample's trajectory) -> ``Group``
(a prompt's rollouts, :mod:`.rollout`) -> ``TrainSample`` -> ``TrainBatch`` -> ``StepResult``
(:mod:`.training`). The run store writes ``Rollout`` rows; environments build ``RolloutState`` and
``RewardResult``. Nothing here imports torch at runtime, so environments stay light to import.
"""

from refractor.records.rollout import (
    DiscardReason,
    EvalRollout,
    Group,
    PromptRef,
    Rollout,
    RolloutStatus,
    ToolCall,
    Turn,
    append_turn_tokens,
    to_train_samples,
)
from refractor.records.sample import (
    PENDING_TOOL_CALLS,
    ChatMessage,
    EvalMetricsResult,
    Messages,
    RewardResult,
    RolloutState,
    Sample,
    ToolCallRecord,
    TrajectoryStep,
    info_turn,
)
from refractor.records.training import MicroBatch, StepResult, TimelineEvent, TrainBatch, TrainSample

__all__ = [
    "PENDING_TOOL_CALLS",
    "ChatMessage",
    "DiscardReason",
    "EvalMetricsResult",
    "EvalRollout",
    "Group",
    "Messages",
    "MicroBatch",
    "PromptRef",
    "RewardResult",
    "Rollout",
    "RolloutState",
    "RolloutStatus",
    "Sample",
    "StepResult",
    "TimelineEvent",
    "ToolCall",
    "ToolCallRecord",
    "TrainBatch",
    "TrainSample",
    "Turn",
    "TrajectoryStep",
    "append_turn_tokens",
    "info_turn",
    "to_train_samples",
]
