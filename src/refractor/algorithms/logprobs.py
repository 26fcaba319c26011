"""Sampled-token log-probs and entropy from hidden states, without [tokens x vocab] fp32 logits.

``chunked_logprobs_entropy(hidden, weight, targets)`` runs the LM head one chunk of rows at a
time: each chunk's logits exist only while that chunk is processed (forward), and are recomputed
in backward (a custom ``autograd.Function``), so peak memory is ``chunk_size x vocab`` instead of
``tokens x vocab``. Gradients flow to ``hidden`` and ``weight`` from both outputs (log-prob for
the policy loss, entropy for the entropy bonus). On CUDA the per-chunk softmax math is compiled
into fused kernels (memory and speed against the naive fp32 computation: bench/RESULTS.md);
elsewhere it runs eagerly.

Temperature: logits are divided by the sampling temperature before the softmax, exactly as the
inference engines do when they report processed (temperature-scaled) log-probs. Temperature 0
means greedy decoding; greedy has no proper distribution, so for log-prob purposes it is treated
as 1.0 (the raw model distribution).
"""

from __future__ import annotations

import os

import torch


def effective_temperature(temperature: float) -> float:
    """The divisor applied to logits: ``temperature``, or 1.0 for greedy (temperature 0)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return 1.0 if temperature == 0 else float(temperature)


def _chunk_bounds(num_rows: int, chunk_size: int) -> list[tuple[int, int]]:
    step = num_rows if chunk_size <= 0 else chunk_size
    return [(s, min(s + step, num_rows)) for s in range(0, num_rows, max(step, 1))]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # softmax math in fp32 at least (float64 inputs stay float64, which gradcheck needs)
    return torch.promote_types(dtype, torch.float32)


def _chunk_forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """One chunk's raw logits [C, V] (matmul dtype) -> log-prob of targets, entropy, logsumexp."""
    z = logits.to(_compute_dtype(logits.dtype)) / temperature
    m = z.amax(dim=-1, keepdim=True)
    shifted = z - m
    e = torch.exp(shifted)
    total = e.sum(-1)
    # H = log S - sum(e * shifted) / S with e = exp(z - max): both terms are >= 0, so nothing cancels
    # for peaked rows (unlike lse - E_p[z]), and both sums share one pass over the chunk
    log_total = torch.log(total)
    entropy = log_total - (e * shifted).sum(-1) / total
    lse = m.squeeze(1) + log_total
    return shifted.gather(1, targets[:, None]).squeeze(1) - log_total, entropy, lse


def _chunk_grad_logits(logits, targets, lse, entropy, grad_logprobs, grad_entropy, temperature: float):
    """Gradient w.r.t. one chunk's raw logits, in the matmul dtype, in one elementwise pass.

    d lp/dz = onehot(y) - p ;  d H/dz = -p * (log p + H) ;  z = logits / T.
    The one-hot term is a comparison with the column index rather than a scatter, so the compiled
    version writes the gradient in the same kernel that reads the logits.
    """
    logp = logits.to(_compute_dtype(logits.dtype)) / temperature - lse[:, None]
    probs = torch.exp(logp)
    coeff = torch.zeros_like(logp)
    if grad_entropy is not None:
        coeff = coeff - grad_entropy[:, None] * (logp + entropy[:, None])
    if grad_logprobs is not None:
        coeff = coeff - grad_logprobs[:, None]
    grad = probs * coeff
    if grad_logprobs is not None:
        columns = torch.arange(logits.shape[1], device=logits.device)
        grad = grad + torch.where(columns[None, :] == targets[:, None], grad_logprobs[:, None], 0.0)
    return (grad / temperature).to(logits.dtype)


_compiled: dict[str, object] = {}


def _kernel(name: str, fn, on_cuda: bool):
    """On CUDA, the chunk math is compiled into a few fused kernels (each [C, V] pass is memory
    bound); elsewhere it runs eagerly. Set REFRACTOR_NO_COMPILE=1 to force eager."""
    if not on_cuda or os.environ.get("REFRACTOR_NO_COMPILE") == "1":
        return fn
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=None)
    return _compiled[name]


def _accumulate_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with ``out`` in fp32 and ``a``, ``b`` in a 16-bit dtype.

    On CUDA the GEMM adds its fp32 accumulators into ``out`` in its epilogue (cuBLAS beta = 1), instead
    of writing a 16-bit product that a second kernel reads and adds (a [V, H] round trip per chunk);
    elsewhere, and for other dtypes, the product is added to ``out``."""
    if out.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and out.dtype == torch.float32:
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:
        out.add_(a @ b)


class _ChunkedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_size: int):
        n = hidden.shape[0]
        dtype = _compute_dtype(hidden.dtype)
        logprobs = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        fwd = _kernel("forward", _chunk_forward, hidden.is_cuda)
        for s, e in _chunk_bounds(n, chunk_size):
            # the matmul runs in the input dtype (bf16 on GPU), as the model's own LM head does
            logprobs[s:e], entropy[s:e], lse[s:e] = fwd(hidden[s:e] @ weight.t(), targets[s:e], temperature)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_h = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None
        # Accumulate the weight gradient over chunks in fp32 (summing bf16 partials loses bits).
        grad_w = (
            torch.zeros(weight.shape, dtype=_compute_dtype(weight.dtype), device=weight.device)
            if need_w
            else None
        )
        bwd = _kernel("backward", _chunk_grad_logits, hidden.is_cuda)
        for s, e in _chunk_bounds(hidden.shape[0], ctx.chunk_size):
            grad_z = bwd(
                hidden[s:e] @ weight.t(),
                targets[s:e],
                lse[s:e],
                entropy[s:e],
                None if grad_logprobs is None else grad_logprobs[s:e],
                None if grad_entropy is None else grad_entropy[s:e],
                ctx.temperature,
            )
            if need_h:
                grad_h[s:e] = grad_z @ weight
            if need_w:
                _accumulate_matmul(grad_w, grad_z.t(), hidden[s:e])
            del grad_z
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def chunked_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise log-prob of ``targets`` and entropy under ``softmax(hidden @ weight.T / T)``.

    hidden: [N, H] (any float dtype), weight: [V, H] (the LM head), targets: [N] int64.
    Returns fp32 (float64 for float64 inputs) ``(logprobs [N], entropy [N])``, both differentiable
    w.r.t. hidden and weight.
    ``chunk_size`` rows are processed at a time (<= 0: all rows at once).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    return _ChunkedLogprobEntropy.apply(
        hidden, weight, targets.long(), effective_temperature(temperature), int(chunk_size)
    )


def token_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies aligned with ``input_ids`` (the records.py convention).

    hidden: [T, H] final hidden states of one packed row, input_ids: [T].
    Value at ``t`` is about token ``t``, predicted from position ``t - 1``; position 0 holds 0.0.
    Across a packed-sample boundary the value is meaningless, which is fine: the first token of
    every sample has loss mask 0 (the packer enforces it).
    """
    logprobs, entropy = chunked_logprobs_entropy(
        hidden[:-1], weight, input_ids[1:], temperature=temperature, chunk_size=chunk_size
    )
    zero = logprobs.new_zeros(1)
    return torch.cat([zero, logprobs]), torch.cat([zero, entropy])
