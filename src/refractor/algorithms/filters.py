"""Output-quality filters (docs/algorithms.md): flagged samples keep their tokens, lose their loss mask.

Applied per rollout before packing, on the same inputs for single- and multi-turn rollouts: the
model-sampled tokens (loss mask 1) with their engine log-probs, the completion text, and whether
generation was truncated (finish reason ``length`` or context exhausted, in every lane mode).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from refractor.records import TrainSample

# ln(100_000): a token id above the threshold sampled below this log-prob is "rare and unlikely".
GIBBERISH_BASE_LOGPROB = 11.5
REPETITION_MIN_CHARS = 100
REPETITION_WINDOW_CHARS = 10_000


@dataclass(frozen=True)
class FilterSettings:
    filter_overlong: bool = False
    filter_gibberish: bool = False
    gibberish_token_threshold: int = 100_000
    gibberish_logprob_offset: float = 2.0
    filter_repetition: bool = False
    repetition_compression_threshold: float = 10.0

    @classmethod
    def from_config(cls, cfg: Any) -> FilterSettings:
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class FilterFlags:
    overlong: bool = False
    gibberish: bool = False
    repetition: bool = False

    @property
    def any(self) -> bool:
        return self.overlong or self.gibberish or self.repetition


def is_gibberish(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    token_threshold: int,
    logprob_offset: float,
    loss_mask: Sequence[int] | None = None,
) -> bool:
    """Any sampled token with id above ``token_threshold`` and log-prob below ``-11.5 - offset``."""
    limit = -GIBBERISH_BASE_LOGPROB - logprob_offset
    mask = loss_mask if loss_mask is not None else [1] * len(token_ids)
    return any(
        m and t > token_threshold and lp < limit for t, lp, m in zip(token_ids, logprobs, mask, strict=True)
    )


def compression_ratio(text: str) -> float:
    data = text[-REPETITION_WINDOW_CHARS:].encode("utf-8")
    return len(data) / len(zlib.compress(data, 1))


def is_repetitive(text: str, threshold: float) -> bool:
    """Completion of >= 100 chars whose last 10k chars compress more than ``threshold`` x (zlib -1)."""
    return len(text) >= REPETITION_MIN_CHARS and compression_ratio(text) > threshold


def output_filter_flags(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    completion_text: str,
    is_truncated: bool,
    settings: FilterSettings,
    *,
    loss_mask: Sequence[int] | None = None,
) -> FilterFlags:
    """Which enabled filters flag this rollout (disabled filters never flag)."""
    return FilterFlags(
        overlong=settings.filter_overlong and is_truncated,
        gibberish=settings.filter_gibberish
        and is_gibberish(
            token_ids,
            logprobs,
            settings.gibberish_token_threshold,
            settings.gibberish_logprob_offset,
            loss_mask,
        ),
        repetition=settings.filter_repetition
        and is_repetitive(completion_text, settings.repetition_compression_threshold),
    )


def sample_filter_flags(
    sample: TrainSample, completion_text: str, is_truncated: bool, settings: FilterSettings
) -> FilterFlags:
    """``output_filter_flags`` on a packed-ready sample (its mask-1 tokens are the sampled ones)."""
    return output_filter_flags(
        sample.input_ids,
        sample.rollout_logprobs,
        completion_text,
        is_truncated,
        settings,
        loss_mask=sample.loss_mask,
    )


def without_loss(sample: TrainSample) -> TrainSample:
    """The same sample with an all-zero loss mask (it still occupies packing space)."""
    return replace(sample, loss_mask=[0] * len(sample.loss_mask))


def filter_metrics(flags: Sequence[FilterFlags], settings: FilterSettings) -> dict[str, float]:
    """``filter/<name>_frac`` over all samples of the batch, for the enabled filters."""
    n = max(len(flags), 1)
    out: dict[str, float] = {}
    for name in ("overlong", "gibberish", "repetition"):
        if getattr(settings, f"filter_{name}"):
            out[f"filter/{name}_frac"] = sum(getattr(f, name) for f in flags) / n
    return out
