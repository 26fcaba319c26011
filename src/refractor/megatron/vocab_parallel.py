"""Sampled-token log-probs and entropy from an LM head split by vocabulary among tensor-parallel ranks.

The same quantities as ``refractor.algorithms.logprobs.chunked_logprobs_entropy`` (temperature,
chunking, recompute in backward, the same per-chunk gradient ``_chunk_grad_logits``), when each
rank holds a block of the head's rows: per chunk, a rank computes its block of logits and, in one pass
over it, the block's softmax statistics against its own maximum (max, sum of exponentials, sum of
``e * shifted``, the target's logit where the rank holds the target); the ranks agree on the global
maximum, rescale their sums to it and add them up over the tensor-parallel group, so no rank ever holds
the whole ``[chunk, vocab]`` logits. Every rank gets the whole log-probs and entropies. The logits'
GEMMs run in the head's dtype (bf16 under mixed precision, as the FSDP trainer's head), the softmax
math in float32 at least, and the log-probs and entropies are float32; on CUDA the per-chunk
elementwise passes are compiled, as in ``algorithms/logprobs.py``.

The backward returns each rank's share of the hidden states' gradient (its block's contribution):
the caller enters the hidden states through a region whose backward sums over the group
(Megatron's ``copy_to_tensor_model_parallel_region`` or ``gather_from_sequence_parallel_region``).
Rows of the padded vocabulary are not passed in: they are not tokens, so they are not in the softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refractor.algorithms.logprobs import (
    _accumulate_matmul,
    _chunk_bounds,
    _chunk_grad_logits,
    _compute_dtype,
    _kernel,
    effective_temperature,
)


def _all_reduce(tensor: torch.Tensor, op, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _block_stats(logits: torch.Tensor, local_targets: torch.Tensor, temperature: float):
    """One chunk's block of raw logits [C, V_r] (V_r > 0) -> per row, with z = logits / T: the block's max
    m, the sums of e = exp(z - m) and of e * (z - m), and z at the target (0 where another rank holds it,
    ``local_targets`` -1)."""
    z = logits.to(_compute_dtype(logits.dtype)) / temperature
    peak = z.amax(dim=-1)
    shifted = z - peak[:, None]
    e = torch.exp(shifted)
    picked = z.gather(1, local_targets.clamp(min=0)[:, None]).squeeze(1)
    return peak, e.sum(-1), (e * shifted).sum(-1), torch.where(local_targets >= 0, picked, 0.0)


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start: int, temperature: float, chunk_size: int, group):
        n = hidden.shape[0]
        dtype = _compute_dtype(hidden.dtype)
        local = targets - vocab_start
        owned = (local >= 0) & (local < weight.shape[0])
        local = torch.where(owned, local, -1)  # -1: the target's logit is another rank's
        logprobs = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        stats = _kernel("vocab_parallel_stats", _block_stats, hidden.is_cuda)
        for s, e in _chunk_bounds(n, chunk_size):
            if weight.shape[0]:
                peak, total, weighted, target = stats(hidden[s:e] @ weight.t(), local[s:e], temperature)
            else:  # a rank whose block is all padding rows: nothing in its share of the softmax
                peak = torch.full((e - s,), -torch.inf, dtype=dtype, device=hidden.device)
                total = weighted = target = torch.zeros(e - s, dtype=dtype, device=hidden.device)
            top = _all_reduce(peak.clone(), dist.ReduceOp.MAX, group)
            # the block's sums rescaled to the global max: sum e' = S_r * c, sum e' * (z - top) =
            # c * (W_r + (m_r - top) * S_r), c = exp(m_r - top)
            scale = torch.exp(peak - top)
            offset = torch.where(total > 0, peak - top, 0.0)
            sums = torch.stack([total * scale, (weighted + offset * total) * scale, target])
            total, weighted, target = _all_reduce(sums, dist.ReduceOp.SUM, group)
            log_total = torch.log(total)
            entropy[s:e] = log_total - weighted / total
            lse[s:e] = top + log_total
            logprobs[s:e] = target - lse[s:e]
        ctx.save_for_backward(hidden, weight, local, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, local, lse, entropy = ctx.saved_tensors
        grad_h = torch.zeros_like(hidden)
        # the weight gradient accumulates over chunks in fp32 (summing bf16 partials loses bits)
        grad_w = torch.zeros(weight.shape, dtype=_compute_dtype(weight.dtype), device=weight.device)
        grad_logits = _kernel("backward", _chunk_grad_logits, hidden.is_cuda)
        for s, e in _chunk_bounds(hidden.shape[0], ctx.chunk_size):
            grad_z = grad_logits(
                hidden[s:e] @ weight.t(),
                local[s:e],
                lse[s:e],
                entropy[s:e],
                None if grad_logprobs is None else grad_logprobs[s:e],
                None if grad_entropy is None else grad_entropy[s:e],
                ctx.temperature,
            )
            grad_h[s:e] = grad_z @ weight
            _accumulate_matmul(grad_w, grad_z.t(), hidden[s:e])
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


def vocab_parallel_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    vocab_start: int,
    targets: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise (log-prob of ``targets`` [N], entropy) as ``chunked_logprobs_entropy`` returns them,
    from this rank's rows ``[vocab_start, vocab_start + V_r)`` of the head (``weight`` [V_r, H]) and
    the hidden states [N, H]."""
    return _VocabParallelLogprobEntropy.apply(
        hidden,
        weight,
        targets.long(),
        int(vocab_start),
        effective_temperature(temperature),
        int(chunk_size),
        group,
    )


def vocab_parallel_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    vocab_start: int,
    input_ids: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (log-prob, entropy) aligned with ``input_ids`` as ``token_logprobs_and_entropy``
    returns them (position 0 holds 0.0), from the whole row's hidden states [T, H]."""
    logprobs, entropy = vocab_parallel_logprobs_entropy(
        hidden[:-1],
        weight,
        vocab_start,
        input_ids[1:],
        group,
        temperature=temperature,
        chunk_size=chunk_size,
    )
    zero = logprobs.new_zeros(1)
    return torch.cat([zero, logprobs]), torch.cat([zero, entropy])
