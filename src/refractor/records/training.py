"""Training-side records: samples the trainer consumes, packed batches, and what a step returns.

Token alignment convention, used everywhere: per-token arrays are aligned with ``input_ids``.
The value at position ``t`` describes token ``t`` itself, which the model predicts from the
logits at position ``t - 1``. So ``loss_mask[t] == 1`` means "token t was sampled by the policy
and its log-prob counts in the loss"; the first token of every sample is never trainable.
``rollout_logprobs[t]`` is the inference engine's log-prob of token ``t`` (0.0 where masked).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: environments import these records without loading torch
    import torch


@dataclass
class TrainSample:
    """One finished, scored rollout as the trainer needs it (all turns, token-exact)."""

    input_ids: list[int]
    loss_mask: list[int]
    advantage: float
    rollout_logprobs: list[float]
    sample_id: int = 0

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"sample {self.sample_id}: input_ids ({n}), loss_mask ({len(self.loss_mask)}) and "
                f"rollout_logprobs ({len(self.rollout_logprobs)}) must have the same length"
            )

    @property
    def num_trainable_tokens(self) -> int:
        return int(sum(self.loss_mask))


@dataclass
class MicroBatch:
    """Samples packed into one row of ``seq_len`` tokens (plus padding). All tensors are 1-D [T]."""

    input_ids: torch.Tensor  # int64
    position_ids: torch.Tensor  # int64, restart at 0 for every sample
    document_ids: torch.Tensor  # int64, sample index within the row; -1 on padding
    cu_seqlens: torch.Tensor  # int32 [num_docs + 1] (padding is one extra trailing doc when present)
    loss_mask: torch.Tensor  # float32, 1.0 on trainable tokens
    advantages: torch.Tensor  # float32, the sample's advantage on each of its tokens
    rollout_logprobs: torch.Tensor  # float32
    sample_ids: list[int] = field(default_factory=list)
    max_seqlen: int = 0
    minibatch: int = 0  # optimizer step within the training step (number_of_minibatches)
    loss_normalizer: float = 1.0  # global divisor of this minibatch's loss (all micro-batches, all ranks)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def is_noop(self) -> bool:
        """A padding-only micro-batch: run forward+backward anyway so collectives stay matched."""
        return not self.sample_ids


@dataclass
class TrainBatch:
    """What one training step consumes: micro-batches for each data-parallel rank.

    ``loss_normalizer`` is global (the same on every rank, computed once per step), so the loss
    does not depend on how samples were packed or distributed.
    """

    step: int
    micro_batches: list[list[MicroBatch]]  # [dp_rank][i]
    loss_normalizer: float
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)  # packing stats (truncations, padding)


@dataclass
class TimelineEvent:
    name: str
    start: float  # unix seconds
    end: float
    component: str = ""
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    """What the trainer returns after a step: metrics named ``section/group/metric`` or plain loss
    metric names (docs/metrics.md#loss-metrics)."""

    step: int
    metrics: dict[str, float]
    timeline: list[TimelineEvent] = field(default_factory=list)
