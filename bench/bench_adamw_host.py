"""AdamW on host tensors (what ``fsdp_cpu_offload`` steps): the default per-tensor loop, foreach, fused.

The offloaded trainer keeps master weights, gradients and both moments in host memory, so its
optimizer step runs on the CPU; this times one step of each of torch's three AdamW implementations
on the same tensors and checks that they agree.

    python bench/bench_adamw_host.py --params-m 134 --tensors 8
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params-m", type=float, default=134.0, help="millions of parameters in all")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    per = int(args.params_m * 1e6 / args.tensors)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(per, generator=gen) for _ in range(args.tensors)]
    grads = [torch.randn(per, generator=gen) for _ in range(args.tensors)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.params_m:.0f}M parameters")
    results = {}
    for mode in ("default", "foreach", "fused"):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        options = {} if mode == "default" else {mode: True}
        optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **options)
        optimizer.step()  # creates the state
        start = time.perf_counter()
        for _ in range(args.steps):
            optimizer.step()
        results[mode] = ((time.perf_counter() - start) / args.steps, params)
    base = results["default"]
    for mode, (seconds, params) in results.items():
        gap = max((p - q).abs().max().item() for p, q in zip(params, base[1], strict=True))
        print(
            f"{mode:8s} {seconds * 1e3:8.1f} ms/step  {base[0] / seconds:5.2f}x the default loop  "
            f"max |difference| from it {gap:.1e}"
        )


if __name__ == "__main__":
    main()
