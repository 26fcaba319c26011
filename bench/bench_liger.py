"""Liger-Kernel's Triton kernels against what the trainer runs today, op by op, forward + backward.

The trainer compiles each decoder layer with Inductor, which fuses the elementwise glue (RMSNorm,
rotary, SiLU-gate) into a few kernels of its own, and computes the LM head's log-probs and entropy
in chunks with a hand-written backward (``refractor.algorithms.logprobs``). A Liger kernel is worth
adopting only where it beats those on this model's shapes; this script measures exactly that, at
the Qwen2.5-0.5B (or 1.5B) shape and 16k tokens in bf16, each side's output checked against a
float64 reference first:

    python bench/bench_liger.py --size 0.5b --tokens 16384

Rows: the op, the eager PyTorch time (the naive reference), the Inductor-compiled time (what the
trainer's compiled layers do at best: an isolated op, with no neighbour to fuse into), Liger's time,
and Liger / Inductor. For the LM head, refractor's chunked log-prob + entropy against Liger's fused
linear cross-entropy (log-probs only, no entropy) and Liger's fused linear GRPO loss (its own
[batch, length] layout; no entropy either).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

SHAPES = {  # hidden, heads, kv heads, head dim, intermediate, vocabulary
    "0.5b": (896, 14, 2, 64, 4864, 151936),
    "1.5b": (1536, 12, 2, 128, 8960, 151936),
}


def cuda_time(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` (forward + backward) over ``iters`` runs, CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def fwd_bwd(op, inputs: list[torch.Tensor], grads: list[torch.Tensor]):
    """A closure running ``op(*inputs)`` and its backward with fixed output gradients."""

    def run():
        for t in inputs:
            t.grad = None
        out = op(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, grads)

    return run


def max_error(fn, reference, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> float:
    """Largest output or input-gradient difference from ``reference`` run in float64, relative to its max."""

    def outputs_and_grads(op, xs):
        xs = [x.detach().clone().requires_grad_(x.requires_grad) for x in xs]
        out = op(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(grads, outs, strict=True)])
        return [o.detach().double() for o in outs] + [x.grad.double() for x in xs if x.requires_grad]

    want = outputs_and_grads(reference, [x.double() for x in inputs])
    got = outputs_and_grads(fn, inputs)
    return max(
        ((g - w).abs().max() / w.abs().max().clamp_min(1e-12)).item() for g, w in zip(got, want, strict=True)
    )


def elementwise_rows(tokens: int, shape, iters: int) -> list[dict]:
    from liger_kernel.transformers.functional import liger_rms_norm, liger_rope, liger_swiglu

    from refractor.models.ops import EAGER

    hidden, heads, kv_heads, head_dim, inter, _ = shape
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*size, grad=True):
        return torch.randn(*size, device=dev, dtype=bf16, generator=g).requires_grad_(grad)

    positions = torch.arange(tokens, device=dev) % 4096
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim))
    angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = angles.cos().to(bf16), angles.sin().to(bf16)

    def rope_pair(fn):
        return lambda q, k: (fn(q, cos, sin), fn(k, cos, sin))

    def liger_rope_ours_layout(q, k):  # [T, heads, dim] viewed as Liger's [1, heads, T, dim]: no copy
        q4, k4 = (x.unsqueeze(0).transpose(1, 2) for x in (q, k))
        qo, ko = liger_rope(q4, k4, cos[None], sin[None])
        return qo.transpose(1, 2).squeeze(0), ko.transpose(1, 2).squeeze(0)

    def rope_reference(q, k):
        return EAGER["apply_rotary"](q, cos.double(), sin.double()), EAGER["apply_rotary"](
            k, cos.double(), sin.double()
        )

    cases = {
        "rms_norm": (
            [rand(tokens, hidden), rand(hidden)],
            [rand(tokens, hidden, grad=False)],
            lambda x, w: EAGER["rms_norm"](x, w, 1e-6),
            lambda x, w: liger_rms_norm(x, w, 1e-6, in_place=False),
            lambda x, w: EAGER["rms_norm"](x, w, 1e-6),
        ),
        "silu_mul": (
            [rand(tokens, inter), rand(tokens, inter)],
            [rand(tokens, inter, grad=False)],
            EAGER["silu_mul"],
            liger_swiglu,
            EAGER["silu_mul"],
        ),
        "rotary (q and k)": (
            [rand(tokens, heads, head_dim), rand(tokens, kv_heads, head_dim)],
            [rand(tokens, heads, head_dim, grad=False), rand(tokens, kv_heads, head_dim, grad=False)],
            rope_pair(EAGER["apply_rotary"]),
            liger_rope_ours_layout,
            rope_reference,
        ),
    }
    rows = []
    for name, (inputs, grads, eager, liger, reference) in cases.items():  # reference: run in float64
        compiled = torch.compile(eager, dynamic=False)
        row = {"op": name, "tokens": tokens}
        for label, fn in (("eager", eager), ("inductor", compiled), ("liger", liger)):
            try:
                row[f"{label}_ms"] = cuda_time(fwd_bwd(fn, inputs, grads), iters)
                row[f"{label}_error"] = max_error(fn, reference, inputs, grads)
            except Exception as err:  # report and keep the other rows
                row[f"{label}_error"] = f"{type(err).__name__}: {err}"[:300]
        if isinstance(row.get("liger_ms"), float) and isinstance(row.get("inductor_ms"), float):
            row["liger_over_inductor"] = row["liger_ms"] / row["inductor_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def head_rows(tokens: int, shape, iters: int) -> list[dict]:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    from refractor.algorithms.logprobs import chunked_logprobs_entropy

    hidden_size, *_, vocab = shape
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1)
    hidden = (torch.randn(tokens, hidden_size, device=dev, generator=g) * 0.5).to(bf16).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device=dev, generator=g) * 0.02).to(bf16).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=dev, generator=g)
    advantages = torch.randn(tokens, device=dev, generator=g)

    def ours():
        hidden.grad = weight.grad = None
        logprobs, entropy = chunked_logprobs_entropy(hidden, weight, targets)
        (-(logprobs * advantages).sum() - 1e-3 * entropy.sum()).backward()

    def liger_ce():
        hidden.grad = weight.grad = None
        liger_fused_linear_cross_entropy(hidden, weight, targets, reduction="sum").backward()

    batch = 16
    grpo = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dr_grpo", chunk_size=1)
    rows3 = hidden.view(batch, tokens // batch, hidden_size)
    ids2, mask2 = targets.view(batch, -1), torch.ones(batch, tokens // batch, device=dev)
    seq_adv = torch.randn(batch, device=dev, generator=g)

    def liger_grpo():
        hidden.grad = weight.grad = None
        out = grpo(rows3, weight, ids2, mask2, seq_adv)
        (out[0] if isinstance(out, tuple) else out).backward()

    rows = []
    for label, fn in (
        ("refractor chunked log-prob + entropy", ours),
        ("liger fused linear cross-entropy (no entropy)", liger_ce),
        ("liger fused linear GRPO loss (no entropy)", liger_grpo),
    ):
        row = {"op": f"LM head: {label}", "tokens": tokens}
        try:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            row["ms"] = cuda_time(fn, iters, warmup=3)
            row["peak_gib_above_inputs"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    shape = SHAPES[args.size]
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, shape {args.size} {shape}")
    rows = elementwise_rows(args.tokens, shape, args.iters) + head_rows(args.tokens, shape, args.iters)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"liger_{args.size}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
