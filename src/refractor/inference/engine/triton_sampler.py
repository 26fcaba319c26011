"""Sampling as one Triton kernel (CUDA only; imported lazily): one pass over each row's logits.

For rows without top-k / top-p / alternatives (the RL default), one program per row reads the
logits once and keeps, over chunks of the vocabulary, the running log-sum-exp of ``logits / T`` and
the running argmax of ``logits / T + Gumbel noise`` (the Gumbel-max trick: that argmax is a draw from
``softmax(logits / T)``); temperature 0 takes the plain argmax. The chosen token's processed
log-prob is its ``logits / T`` minus the log-sum-exp, as the torch path computes it. The noise
comes from Philox keyed by a per-row 63-bit seed (``sampler.step_seeds``), so a row's draw depends
only on its seed, never on the rest of the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    vocab,
    temperatures_ptr,
    seeds_ptr,
    tokens_ptr,
    logprobs_ptr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    seed = tl.load(seeds_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    cols = tl.arange(0, BLOCK)
    running_max = tl.full([BLOCK], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK], tl.float32)
    best_score = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        index = start + cols
        valid = index < vocab
        x = tl.load(base + index, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
        new_max = tl.maximum(running_max, x)
        # lanes still at -inf add nothing (exp(-inf - -inf) would be NaN)
        scale = tl.where(new_max == float("-inf"), 0.0, tl.exp(running_max - new_max))
        term = tl.where(new_max == float("-inf"), 0.0, tl.exp(x - new_max))
        running_sum = running_sum * scale + term
        running_max = new_max
        uniform = tl.rand(seed, index)  # [0, 1): -log(-log(0)) = -inf never wins
        gumbel = -tl.log(-tl.log(uniform))
        score = tl.where(greedy, x, x + gumbel)
        score = tl.where(valid, score, float("-inf"))
        better = score > best_score
        best_score = tl.where(better, score, best_score)
        best_index = tl.where(better, index, best_index)
    row_max = tl.max(running_max, 0)
    row_sum = tl.sum(running_sum * tl.exp(running_max - row_max), 0)
    top = tl.max(best_score, 0)
    # the lowest index among the lanes holding the best score (torch.argmax's tie rule)
    token = tl.min(tl.where(best_score == top, best_index, vocab), 0)
    chosen = tl.load(base + token).to(tl.float32) * inv_t
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, chosen - row_max - tl.log(row_sum))


def sample_triton(
    logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype), temperatures [B] float32 (0: greedy), seeds [B] int64 ->
    (tokens [B] int64, processed log-probs [B] float32)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _sample_kernel[(rows,)](
        logits, logits.stride(0), vocab, temperatures, seeds, tokens, logprobs, BLOCK=2048, num_warps=8
    )
    return tokens, logprobs
