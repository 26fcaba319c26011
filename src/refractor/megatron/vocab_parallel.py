"""Sampled-token log-probs and entropy from an LM head split by vocabulary among tensor-parallel ranks.

The same quantities as ``refractor.algorithms.logprobs.chunked_logprobs_entropy`` (temperature,
chunking, recompute in backward, the same per-chunk gradient ``_chunk_grad_logits``), when each
rank holds a block of the head's rows: per chunk, a rank computes its block of logits, and the
softmax statistics (max, sum of exponentials, sum of ``e * shifted``, the target's logit from the
rank that holds it) are summed over the tensor-parallel group, so no rank ever holds the whole
``[chunk, vocab]`` logits. Every rank gets the whole log-probs and entropies.

The backward returns each rank's share of the hidden states' gradient (its block's contribution):
the caller enters the hidden states through a region whose backward sums over the group
(Megatron's ``copy_to_tensor_model_parallel_region`` or ``gather_from_sequence_parallel_region``).
Rows of the padded vocabulary are not passed in: they are not tokens, so they are not in the softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refractor.algorithms.logprobs import (
    _chunk_bounds,
    _chunk_grad_logits,
    _compute_dtype,
    effective_temperature,
)


def _all_reduce(tensor: torch.Tensor, op, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


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
        for s, e in _chunk_bounds(n, chunk_size):
            z = (hidden[s:e] @ weight.t()).to(dtype) / temperature
            peak = z.amax(dim=-1) if z.shape[1] else z.new_full((e - s,), -torch.inf)
            peak = _all_reduce(peak, dist.ReduceOp.MAX, group)
            shifted = z - peak[:, None]
            exp = torch.exp(shifted)
            picked = (
                shifted.gather(1, local[s:e].clamp(min=0)[:, None]).squeeze(1) if z.shape[1] else peak * 0
            )
            sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1), torch.where(owned[s:e], picked, 0.0)])
            total, weighted, target = _all_reduce(sums, dist.ReduceOp.SUM, group)
            log_total = torch.log(total)
            entropy[s:e] = log_total - weighted / total
            lse[s:e] = peak + log_total
            logprobs[s:e] = target - log_total
        ctx.save_for_backward(hidden, weight, local, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, local, lse, entropy = ctx.saved_tensors
        grad_h = torch.zeros_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=_compute_dtype(weight.dtype), device=weight.device)
        for s, e in _chunk_bounds(hidden.shape[0], ctx.chunk_size):
            grad_z = _chunk_grad_logits(
                hidden[s:e] @ weight.t(),
                local[s:e],
                lse[s:e],
                entropy[s:e],
                None if grad_logprobs is None else grad_logprobs[s:e],
                None if grad_entropy is None else grad_entropy[s:e],
                ctx.temperature,
            )
            grad_h[s:e] = grad_z @ weight
            grad_w.add_(grad_z.t().to(grad_w.dtype) @ hidden[s:e].to(grad_w.dtype))
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


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
    returns them (position 0 holds 0.0), from this rank's rows ``[vocab_start, vocab_start + V_r)`` of
    the head (``weight`` [V_r, H]) and the whole row's hidden states [T, H]."""
    logprobs, entropy = _VocabParallelLogprobEntropy.apply(
        hidden[:-1],
        weight,
        input_ids[1:].long(),
        int(vocab_start),
        effective_temperature(temperature),
        int(chunk_size),
        group,
    )
    zero = logprobs.new_zeros(1)
    return torch.cat([zero, logprobs]), torch.cat([zero, entropy])
