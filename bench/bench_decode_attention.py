"""The paged decode attention kernel alone: time per call and achieved bandwidth (GPU only).

    PYTHONPATH=src python bench/bench_decode_attention.py [--batches 256] [--contexts 384,1024,4096]

Qwen2.5-0.5B's attention shape (14 query heads, 2 KV heads, head dim 64, bf16), 32-token KV
blocks scattered at random. Each kernel setting (context tokens per loop iteration, warps, context
shares per program: 0 = the engine's choice for the batch) is checked against the torch reference
and timed with CUDA events over CUDA-graph replays (GPU time, as in the engine); the first setting is
the baseline.
"""

from __future__ import annotations

import argparse

import torch

from refractor.inference.engine.attention import paged_decode_attention_torch, split_count
from refractor.inference.engine.triton_attention import paged_decode_attention_triton


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="256")
    parser.add_argument("--contexts", default="384,1024,4096")
    parser.add_argument("--settings", default="32:4:1,64:4:1,128:4:1,128:8:1,256:8:1")
    args = parser.parse_args()
    print(torch.cuda.get_device_name())
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            bench_shape(batch, context, args.settings)


def bench_shape(batch: int, context: int, settings: str) -> None:
    heads, kv_heads, dim, block = 14, 2, 64, 32
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = -(-context // block)
    num_blocks = batch * blocks_per_seq + 1
    kc = torch.randn(num_blocks, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    tables = torch.randperm(num_blocks - 1, device="cuda", generator=gen)[: batch * blocks_per_seq]
    tables = tables.view(batch, blocks_per_seq).int()
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = paged_decode_attention_torch(q, kc, vc, tables, lens).float()
    read_bytes = 2 * batch * context * kv_heads * dim * 2
    base = None
    for setting in settings.split(","):
        tile, warps, splits = (int(x) for x in setting.split(":"))
        splits = splits or split_count(batch, kv_heads, q.device)
        inputs = (q, kc, vc, tables, lens)

        def call(inputs=inputs, tile=tile, warps=warps, splits=splits):
            return paged_decode_attention_triton(*inputs, tile=tile, num_warps=warps, splits=splits)

        err = (call().float() - ref).abs().max().item()
        # timed as the engine runs it, inside a CUDA graph: GPU time, no launch overhead
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                call()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 5  # ms per 200 calls -> us per call
        base = base or us
        print(
            f"batch {batch:4d} context {context:6d} tile {tile:4d} warps {warps} splits {splits:2d}: "
            f"{us:7.1f} us  {read_bytes / us / 1e6:5.2f} TB/s  x{base / us:.2f} vs the first  "
            f"max err {err:.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
