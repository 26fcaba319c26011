"""Forward passes from packed rows: concatenate a minibatch's rows into longer passes.

The packer makes rows of at most ``seq_len`` tokens (the sample length limit). On a GPU, a
forward/backward pass costs a fixed amount of host work per decoder layer (FSDP hooks, kernel
launches) whatever its length, so four 4k-token rows cost about four times the host time of one
16k-token pass with the same GPU work. ``merge_rows`` concatenates rows (first-fit-decreasing by
length) into passes of at most ``max_tokens``: document ids are renumbered so that samples stay
isolated by the block-causal mask, positions already restart per sample, and the loss of a merged
pass is the sum of its rows' losses (the normalizer is global), so the step's loss and gradients
are those of the unmerged rows up to summation order.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from refractor.algorithms.packing import first_fit_decreasing
from refractor.records import MicroBatch


def merge_rows(rows: list[MicroBatch], max_tokens: int) -> list[MicroBatch]:
    """Rows of ONE minibatch -> passes of at most ``max_tokens`` tokens (``max_tokens <= 0``: unchanged).

    No-op rows (padding only) are dropped when the minibatch has real rows: they contribute nothing.
    A row longer than ``max_tokens`` forms a pass of its own.
    """
    if max_tokens <= 0 or len(rows) <= 1:
        return list(rows)
    real = [mb for mb in rows if not mb.is_noop] or rows[:1]
    bins = first_fit_decreasing([min(mb.num_tokens, max_tokens) for mb in real], max_tokens)
    return [concat_rows([real[i] for i in sorted(b)]) for b in sorted(bins, key=min)]


def concat_rows(rows: list[MicroBatch]) -> MicroBatch:
    """One row made of ``rows`` back to back (same minibatch and normalizer)."""
    if len(rows) == 1:
        return rows[0]
    first = rows[0]
    documents = []
    offset = 0
    for mb in rows:
        docs = mb.document_ids
        documents.append(torch.where(docs >= 0, docs + offset, docs))
        offset += len(mb.sample_ids)  # ids are 0..len(sample_ids)-1 (records.py)
    cu = [rows[0].cu_seqlens]
    total = int(rows[0].input_ids.numel())
    for mb in rows[1:]:
        cu.append(mb.cu_seqlens[1:] + total)
        total += int(mb.input_ids.numel())

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(mb, name) for mb in rows])

    return replace(
        first,
        input_ids=cat("input_ids"),
        position_ids=cat("position_ids"),
        document_ids=torch.cat(documents),
        cu_seqlens=torch.cat(cu),
        loss_mask=cat("loss_mask"),
        advantages=cat("advantages"),
        rollout_logprobs=cat("rollout_logprobs"),
        sample_ids=[i for mb in rows for i in mb.sample_ids],
        max_seqlen=max(mb.max_seqlen for mb in rows),
    )


def pad_row(mb: MicroBatch, multiple: int, pad_token_id: int) -> MicroBatch:
    """``mb`` padded at the end to a multiple of ``multiple`` tokens (``multiple <= 0``: unchanged).

    The padding is one trailing segment, as the packer pads a row: document id -1 (it attends only
    to itself), loss mask 0, advantage 0, positions from 0. The pass's loss and gradients are
    unchanged; the compiled layers see one static shape per multiple (``trainer_pass_pad_multiple``).
    """
    length = int(mb.input_ids.numel())
    pad = -length % multiple if multiple > 0 else 0
    if pad == 0:
        return mb

    def extend(x: torch.Tensor, value) -> torch.Tensor:
        return torch.cat([x, torch.full((pad,), value, dtype=x.dtype, device=x.device)])

    cu = mb.cu_seqlens
    return replace(
        mb,
        input_ids=extend(mb.input_ids, pad_token_id),
        position_ids=torch.cat(
            [mb.position_ids, torch.arange(pad, dtype=mb.position_ids.dtype, device=mb.position_ids.device)]
        ),
        document_ids=extend(mb.document_ids, -1),
        cu_seqlens=torch.cat([cu, cu.new_tensor([length + pad])]),
        loss_mask=extend(mb.loss_mask, 0),
        advantages=extend(mb.advantages, 0),
        rollout_logprobs=extend(mb.rollout_logprobs, 0),
        max_seqlen=max(mb.max_seqlen, pad),
    )
