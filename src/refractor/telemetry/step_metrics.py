"""The metrics of one training step, as the orchestrator stores them after the step's weight update.

One pure function over what the train loop measured: the step's rollouts (kept, discarded and
cancelled), the trainer's own metrics, the step's timing, and the timeline events of the trainer
and of the weight sync (names: docs/metrics.md#step-metrics).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from refractor.records import TimelineEvent
from refractor.telemetry.metrics import RolloutSummary, rollout_step_metrics


@dataclass(frozen=True)
class StepTiming:
    """Seconds of one training step."""

    waiting_for_data: float  # the train loop waited for the step's batch
    train_step: float
    weight_sync: float  # the push of the new weights, without time held back by deterministic_rollouts
    step_total: float  # since the previous step ended (the first step: since it began waiting)


def step_metrics(
    rollouts: Sequence[RolloutSummary],
    trainer_metrics: Mapping[str, float],
    timing: StepTiming,
    completion_tokens: int,
    async_level: int,
    version: int,
    events: Sequence[TimelineEvent],
) -> dict[str, float]:
    """``completion_tokens``: of the kept rollouts; ``version``: the weights the step produced."""
    metrics = rollout_step_metrics(rollouts)
    metrics |= {k: float(v) for k, v in trainer_metrics.items()}
    total = timing.step_total
    metrics |= {
        "timing_waiting_for_data": timing.waiting_for_data,
        "timing_train_step": timing.train_step,
        "timing_weight_sync_total": timing.weight_sync,
        "timing_step_total": total,
        "tokens_per_second": completion_tokens / total if total > 0 else 0.0,
        "async_level": float(async_level),
        "policy_version": float(version),
    }
    for e in events:  # the trainer side's own account of the sync
        if e.name == "weight_sync" and "trainer_seconds" in e.attrs:
            metrics["timing_weight_sync_trainer_total"] = float(e.attrs["trainer_seconds"])
            metrics["timing_weight_sync_inference_total"] = float(e.attrs["paused_seconds"])
    return metrics
