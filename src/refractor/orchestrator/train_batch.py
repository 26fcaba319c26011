"""A cut batch as the trainer and the step metrics see it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from refractor.algorithms.advantages import AdvantageSettings, normalize_batch_advantages
from refractor.algorithms.filters import FilterSettings, filter_metrics, sample_filter_flags, without_loss
from refractor.records import Rollout, TrainSample, to_train_samples


def train_samples(
    rollouts: Sequence[Rollout], advantages: AdvantageSettings, filters: FilterSettings
) -> tuple[list[TrainSample], dict[str, float]]:
    """Kept rollouts -> trainer samples: batch-level advantage normalization, then output filters."""
    normalized = normalize_batch_advantages([r.advantage for r in rollouts], advantages)
    samples = []
    flags = []
    for r, adv in zip(rollouts, normalized, strict=True):
        for s in to_train_samples(r):
            f = sample_filter_flags(s, r.completion_text, r.is_truncated, filters)
            flags.append(f)
            s = replace(s, advantage=adv)
            samples.append(without_loss(s) if f.any else s)
    return samples, filter_metrics(flags, filters)
