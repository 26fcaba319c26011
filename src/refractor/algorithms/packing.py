"""Sequence packing: TrainSamples -> minibatches -> DP ranks -> micro-batches (rows of <= seq_len).

Order of decisions (``pack_train_batch``):
1. Samples longer than ``seq_len`` are truncated (counted in ``packing/truncated_*``), and the
   first token of every sample is made non-trainable (nothing in the row predicts it).
2. Samples are split, in order, into ``number_of_minibatches`` contiguous minibatches (one
   optimizer step each); each minibatch gets one global loss normalizer (``loss_normalizer``).
3. A minibatch's samples go to DP ranks longest-first, each to the rank with the fewest tokens so
   far, so rank token counts differ by at most one sample's length.
4. Each rank packs its samples first-fit-decreasing into rows of at most ``seq_len`` tokens, padded
   to a multiple of ``pad_to_multiple_of`` with the tokenizer's pad id (mask 0, document id -1).
5. Ranks with fewer rows than the busiest rank get no-op rows (``pad_to_multiple_of`` padding
   tokens, ``MicroBatch.is_noop``) instead of full-size ghost copies. FSDP all-gathers and
   reduce-scatters in every forward/backward, so every rank must run forward+backward on each of
   its rows, no-op rows included (their loss is exactly 0); all ranks then do the same number of
   passes per minibatch and the same number of optimizer steps.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from refractor.algorithms.loss import Aggregation, LossSettings, loss_normalizer
from refractor.records import MicroBatch, TrainBatch, TrainSample


@dataclass(frozen=True)
class PackingSettings:
    """The config fields packing reads, and the tokenizer's pad id."""

    seq_len: int
    pad_to_multiple_of: int
    pad_token_id: int
    number_of_minibatches: int
    aggregation: Aggregation  # selects the loss normalizer (LossSettings.aggregation)
    max_tokens: int  # the token_sum_norm budget per sample

    @classmethod
    def from_config(cls, cfg: Any, pad_token_id: int) -> PackingSettings:
        return cls(
            seq_len=cfg.seq_len,
            pad_to_multiple_of=cfg.pad_to_multiple_of,
            pad_token_id=pad_token_id,
            number_of_minibatches=cfg.number_of_minibatches,
            aggregation=LossSettings.from_config(cfg).aggregation,
            max_tokens=cfg.max_tokens,
        )


@dataclass(frozen=True)
class _Prepared:
    sample: TrainSample
    input_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]

    @property
    def length(self) -> int:
        return len(self.input_ids)


def _prepare(sample: TrainSample, seq_len: int) -> _Prepared:
    if not sample.input_ids:
        raise ValueError(f"sample {sample.sample_id} has no tokens")
    mask = [int(bool(m)) for m in sample.loss_mask[:seq_len]]
    mask[0] = 0
    return _Prepared(sample, list(sample.input_ids[:seq_len]), mask, list(sample.rollout_logprobs[:seq_len]))


def split_minibatches(n: int, number_of_minibatches: int) -> list[range]:
    """Contiguous, nearly equal index ranges (sizes differ by at most 1); empty ones dropped."""
    k = max(1, min(number_of_minibatches, n))
    base, extra = divmod(n, k)
    bounds = []
    start = 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        bounds.append(range(start, start + size))
        start += size
    return [b for b in bounds if len(b)]


def balance_over_ranks(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Indices per rank: longest first, each to the least-loaded rank (ties: lowest rank)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap = [(0, r) for r in range(num_ranks)]
    shards: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in order:
        load, r = heapq.heappop(heap)
        shards[r].append(i)
        heapq.heappush(heap, (load + lengths[i], r))
    return shards


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices per bin: longest first, each into the first bin with room (every length <= capacity)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def _padded_length(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_micro_batch(
    parts: Sequence[_Prepared], pad_to_multiple_of: int, pad_token_id: int, minibatch: int, normalizer: float
) -> MicroBatch:
    """Concatenate samples into one row (positions restart per sample) and pad it."""
    ids: list[int] = []
    pos: list[int] = []
    doc: list[int] = []
    mask: list[int] = []
    adv: list[float] = []
    lps: list[float] = []
    cu = [0]
    for d, p in enumerate(parts):
        ids += p.input_ids
        pos += range(p.length)
        doc += [d] * p.length
        mask += p.loss_mask
        adv += [float(p.sample.advantage)] * p.length
        lps += p.rollout_logprobs
        cu.append(cu[-1] + p.length)
    used = len(ids)
    pad = _padded_length(max(used, 1), pad_to_multiple_of) - used
    if pad:
        ids += [pad_token_id] * pad
        pos += range(pad)  # the padding is its own trailing segment
        doc += [-1] * pad
        mask += [0] * pad
        adv += [0.0] * pad
        lps += [0.0] * pad
        cu.append(cu[-1] + pad)
    seg_lengths = [b - a for a, b in zip(cu, cu[1:], strict=False)]
    return MicroBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        position_ids=torch.tensor(pos, dtype=torch.int64),
        document_ids=torch.tensor(doc, dtype=torch.int64),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32),
        rollout_logprobs=torch.tensor(lps, dtype=torch.float32),
        sample_ids=[p.sample.sample_id for p in parts],
        max_seqlen=max(seg_lengths),
        minibatch=minibatch,
        loss_normalizer=normalizer,
    )


def pack_train_batch(
    samples: Sequence[TrainSample],
    *,
    step: int,
    seq_len: int,
    pad_to_multiple_of: int,
    pad_token_id: int,
    num_dp_ranks: int = 1,
    number_of_minibatches: int = 1,
    aggregation: Aggregation = "token_mean",
    max_tokens: int = 1,
) -> TrainBatch:
    """Pack one training step's samples for ``num_dp_ranks`` data-parallel ranks (module docstring).

    ``aggregation``/``max_tokens`` select the loss normalizer (``LossSettings.aggregation`` and the
    config's ``max_tokens``). ``micro_batches[rank]`` lists that rank's rows, minibatch by minibatch;
    each row carries its ``minibatch`` index and that minibatch's global ``loss_normalizer``.
    ``TrainBatch.loss_normalizer`` is the whole step's (equal to the row's when there is one minibatch).
    """
    if not samples:
        raise ValueError("pack_train_batch needs at least one sample")
    if seq_len < 1 or pad_to_multiple_of < 1 or num_dp_ranks < 1:
        raise ValueError(
            f"seq_len ({seq_len}), pad_to_multiple_of ({pad_to_multiple_of}) and "
            f"num_dp_ranks ({num_dp_ranks}) must be >= 1"
        )
    prepared = [_prepare(s, seq_len) for s in samples]
    truncated = [s for s in samples if len(s.input_ids) > seq_len]
    ranks: list[list[MicroBatch]] = [[] for _ in range(num_dp_ranks)]
    noop = 0
    for mb_index, span in enumerate(split_minibatches(len(prepared), number_of_minibatches)):
        members = [prepared[i] for i in span]
        normalizer = loss_normalizer(
            sum(sum(p.loss_mask) for p in members), len(members), aggregation, max_tokens
        )
        shards = balance_over_ranks([p.length for p in members], num_dp_ranks)
        rows_per_rank = []
        for shard in shards:
            parts = [members[i] for i in shard]
            bins = first_fit_decreasing([p.length for p in parts], seq_len)
            rows_per_rank.append(
                [
                    build_micro_batch(
                        [parts[i] for i in b], pad_to_multiple_of, pad_token_id, mb_index, normalizer
                    )
                    for b in bins
                ]
            )
        most = max(len(rows) for rows in rows_per_rank)
        for rank, rows in enumerate(rows_per_rank):
            while len(rows) < most:
                rows.append(build_micro_batch([], pad_to_multiple_of, pad_token_id, mb_index, normalizer))
                noop += 1
            ranks[rank] += rows
    all_rows = [mb for rows in ranks for mb in rows]
    real_tokens = sum(p.length for p in prepared)
    total_tokens = sum(mb.num_tokens for mb in all_rows)
    step_normalizer = loss_normalizer(
        sum(sum(p.loss_mask) for p in prepared), len(prepared), aggregation, max_tokens
    )
    metrics = {
        "packing/micro_batches": float(len(all_rows) - noop),
        "packing/noop_micro_batches": float(noop),
        "packing/tokens": float(real_tokens),
        "packing/padding_tokens": float(total_tokens - real_tokens),
        "packing/truncated_samples": float(len(truncated)),
        "packing/truncated_tokens": float(sum(len(s.input_ids) - seq_len for s in truncated)),
    }
    return TrainBatch(
        step=step,
        micro_batches=ranks,
        loss_normalizer=step_normalizer,
        num_samples=len(prepared),
        metrics=metrics,
    )


def pack_step(
    samples: Sequence[TrainSample], step: int, settings: PackingSettings, num_dp_ranks: int
) -> TrainBatch:
    """``pack_train_batch`` with a run's packing settings: one step's samples for ``num_dp_ranks`` ranks."""
    return pack_train_batch(
        samples,
        step=step,
        seq_len=settings.seq_len,
        pad_to_multiple_of=settings.pad_to_multiple_of,
        pad_token_id=settings.pad_token_id,
        num_dp_ranks=num_dp_ranks,
        number_of_minibatches=settings.number_of_minibatches,
        aggregation=settings.aggregation,
        max_tokens=settings.max_tokens,
    )
