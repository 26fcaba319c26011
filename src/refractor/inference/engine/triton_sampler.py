"""Sampling in Triton kernels (CUDA only; imported lazily): one pass over each row's logits.

For rows without top-k / top-p / alternatives (the RL default), each row's vocabulary is split
over a few programs (enough to fill the GPU); each reads its slice of the logits once and keeps
the running log-sum-exp of ``logits / T`` and the running argmax of ``logits / T + Gumbel noise``
(the Gumbel-max trick: that argmax is a draw from ``softmax(logits / T)``); temperature 0 takes
the plain argmax. A second kernel merges the slices. The chosen token's processed log-prob is its
``logits / T`` minus the log-sum-exp, as the torch path computes it. The noise comes from Philox
keyed by a per-row 63-bit seed (``sampler.step_seeds``) and the token id, so a row's draw depends
only on its seed, never on the rest of the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_partial_kernel(
    logits_ptr,
    stride_row,
    vocab,
    chunk,
    temperatures_ptr,
    inv_temperatures_ptr,
    seeds_ptr,
    partial_ptr,  # [rows, SPLITS, 4] float32: max, sum of exp(x - max), best score, best index
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    greedy = tl.load(temperatures_ptr + row) == 0.0
    inv_t = tl.load(inv_temperatures_ptr + row)
    seed = tl.load(seeds_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    cols = tl.arange(0, BLOCK)
    running_max = tl.full([BLOCK], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK], tl.float32)
    best_score = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32)
    first = split * chunk
    last = tl.minimum(first + chunk, vocab)
    for start in range(first, last, BLOCK):
        index = start + cols
        valid = index < last
        x = tl.load(base + index, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
        new_max = tl.maximum(running_max, x)
        # lanes still at -inf add nothing (exp(-inf - -inf) would be NaN)
        scale = tl.where(new_max == float("-inf"), 0.0, tl.exp(running_max - new_max))
        term = tl.where(new_max == float("-inf"), 0.0, tl.exp(x - new_max))
        running_sum = running_sum * scale + term
        running_max = new_max
        uniform = tl.rand(seed, index)  # [0, 1): -log(-log(0)) = -inf never wins
        score = tl.where(greedy, x, x - tl.log(-tl.log(uniform)))
        score = tl.where(valid, score, float("-inf"))
        better = score > best_score
        best_score = tl.where(better, score, best_score)
        best_index = tl.where(better, index, best_index)
    split_max = tl.max(running_max, 0)
    safe_max = tl.where(split_max == float("-inf"), 0.0, split_max)
    split_sum = tl.sum(running_sum * tl.exp(running_max - safe_max), 0)
    top = tl.max(best_score, 0)
    # the lowest index among the lanes holding the best score (torch.argmax's tie rule)
    token = tl.min(tl.where(best_score == top, best_index, vocab), 0)
    out = partial_ptr + (row * SPLITS + split) * 4
    tl.store(out, split_max)
    tl.store(out + 1, split_sum)
    tl.store(out + 2, top)
    tl.store(out + 3, token.to(tl.float32))


@triton.jit
def _sample_merge_kernel(
    logits_ptr,
    stride_row,
    vocab,
    inv_temperatures_ptr,
    partial_ptr,
    tokens_ptr,
    logprobs_ptr,
    SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    inv_t = tl.load(inv_temperatures_ptr + row)
    parts = partial_ptr + (row * SPLITS + tl.arange(0, SPLITS)) * 4
    split_max = tl.load(parts)
    split_sum = tl.load(parts + 1)
    score = tl.load(parts + 2)
    index = tl.load(parts + 3).to(tl.int32)
    row_max = tl.max(split_max, 0)
    total = tl.sum(tl.where(split_max == float("-inf"), 0.0, split_sum * tl.exp(split_max - row_max)), 0)
    top = tl.max(score, 0)
    token = tl.min(tl.where(score == top, index, vocab), 0)
    chosen = tl.load(logits_ptr + row.to(tl.int64) * stride_row + token).to(tl.float32) * inv_t
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, chosen - row_max - tl.log(total))


@triton.jit
def _rank_kernel(
    logits_ptr,
    stride_row,
    vocab,
    chunk,
    inv_temperatures_ptr,
    tokens_ptr,
    ranks_ptr,  # [rows] int32, zeroed: each program adds the tokens of its slice that beat the chosen
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    inv_t = tl.load(inv_temperatures_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    chosen = tl.load(base + tl.load(tokens_ptr + row)).to(tl.float32) * inv_t
    cols = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], tl.int32)
    first = split * chunk
    last = tl.minimum(first + chunk, vocab)
    for start in range(first, last, BLOCK):
        index = start + cols
        x = tl.load(base + index, mask=index < last, other=float("-inf")).to(tl.float32) * inv_t
        count += (x > chosen).to(tl.int32)
    tl.atomic_add(ranks_ptr + row, tl.sum(count, 0))


BLOCK = 2048


def split_count(rows: int, vocab: int, block: int = BLOCK) -> int:
    """Programs per row: enough to fill the GPU at small batches, from three values only (each is
    a compiled variant of the kernels, built when the engine starts)."""
    splits = 16 if rows <= 64 else 4 if rows <= 256 else 1
    return min(splits, triton.next_power_of_2(-(-vocab // block)))


def sample_triton(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    with_ranks: bool = False,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logits [B, V] (any float dtype), temperatures [B] float32 (0: greedy), seeds [B] int64 ->
    (tokens [B] int64, processed log-probs [B] float32, ranks [B] int32 or None): a token's rank
    is 1 + the number of tokens whose ``logits * (1 / T)`` exceeds its own. ``block``: vocabulary
    entries per loop iteration (a power of two)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    # x * (1 / T) with the reciprocal from torch: ranks count on exactly these values
    inverse = 1.0 / torch.where(temperatures == 0, 1.0, temperatures)
    # enough programs to fill the GPU: the vocabulary is split across programs, then merged
    splits = split_count(rows, vocab, block)
    chunk = -(-vocab // (splits * block)) * block
    partial = torch.empty(rows, splits, 4, dtype=torch.float32, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _sample_partial_kernel[(rows, splits)](
        logits,
        logits.stride(0),
        vocab,
        chunk,
        temperatures,
        inverse,
        seeds,
        partial,
        SPLITS=splits,
        BLOCK=block,
        num_warps=8,
    )
    _sample_merge_kernel[(rows,)](
        logits, logits.stride(0), vocab, inverse, partial, tokens, logprobs, SPLITS=splits, num_warps=1
    )
    if not with_ranks:
        return tokens, logprobs, None
    ranks = torch.zeros(rows, dtype=torch.int32, device=logits.device)
    _rank_kernel[(rows, splits)](
        logits, logits.stride(0), vocab, chunk, inverse, tokens, ranks, BLOCK=block, num_warps=8
    )
    return tokens, logprobs, ranks + 1
