"""The paged decode attention kernel alone: time per call and achieved bandwidth (GPU only).

    PYTHONPATH=src python bench/bench_decode_attention.py [--batch 256] [--contexts 384,1024,4096]

Qwen2.5-0.5B's attention shape (14 query heads, 2 KV heads, head dim 64, bf16), 32-token KV
blocks scattered at random. Each kernel setting (context tokens per loop iteration, warps) is
checked against the torch reference and timed with CUDA events; the first setting, one KV block
per iteration, is the baseline.
"""

from __future__ import annotations

import argparse

import torch

from refractor.inference.engine.attention import paged_decode_attention_torch
from refractor.inference.engine.triton_attention import paged_decode_attention_triton


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--contexts", default="384,1024,4096")
    parser.add_argument("--settings", default="32:4,64:4,128:4,128:8,256:8")
    args = parser.parse_args()
    heads, kv_heads, dim, block = 14, 2, 64, 32
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(torch.cuda.get_device_name())
    for context in (int(c) for c in args.contexts.split(",")):
        blocks_per_seq = -(-context // block)
        num_blocks = args.batch * blocks_per_seq + 1
        kc = torch.randn(num_blocks, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        vc = torch.randn_like(kc)
        tables = torch.randperm(num_blocks - 1, device="cuda", generator=gen)[: args.batch * blocks_per_seq]
        tables = tables.view(args.batch, blocks_per_seq).int()
        lens = torch.full((args.batch,), context, device="cuda", dtype=torch.int32)
        q = torch.randn(args.batch, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = paged_decode_attention_torch(q, kc, vc, tables, lens).float()
        read_bytes = 2 * args.batch * context * kv_heads * dim * 2
        base = None
        for setting in args.settings.split(","):
            tile, warps = (int(x) for x in setting.split(":"))

            inputs = (q, kc, vc, tables, lens)

            def call(inputs=inputs, tile=tile, warps=warps):
                return paged_decode_attention_triton(*inputs, tile=tile, num_warps=warps)

            err = (call().float() - ref).abs().max().item()
            for _ in range(5):
                call()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(100):
                call()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 10  # ms per 100 calls -> us per call
            base = base or us
            print(
                f"context {context:5d} tile {tile:4d} warps {warps}: {us:7.1f} us  "
                f"{read_bytes / us / 1e6:5.2f} TB/s  x{base / us:.2f} vs tile 32  max err {err:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
