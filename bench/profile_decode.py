"""Where a decode step of the native engine spends its GPU time, kernel by kernel (GPU only).

    PYTHONPATH=src:bench python bench/profile_decode.py [--concurrency 256] [--context 384] [--steps 20]

A random Qwen2.5-0.5B-shaped engine holds ``concurrency`` sequences of ``context`` tokens; the
decode steps (graph replay, LM head, sampling) run under ``torch.profiler``. Printed: the wall time
of a step, the GPU time summed per kernel (top 25), and the GPU time as a share of the step (the
rest is the host: scheduling, input copies, the sampler's device-to-host reads).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    from bench_engine import random_qwen_05b

    from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams

    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--context", type=int, default=384)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (kernels named per module)")
    parser.add_argument("--trace", default=None, help="write a Chrome trace here")
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="the host launches each step before recording the last",
    )
    args = parser.parse_args()

    model, _ = random_qwen_05b()
    config = EngineConfig(
        max_model_len=args.context + 4 * args.steps + 64,
        max_num_seqs=args.concurrency,
        gpu_memory_utilization=0.8,
        enforce_eager=args.eager,
        async_scheduling=args.async_scheduling,
    )
    engine = LLMEngine(model, config)
    params = SamplingParams(temperature=1.0, max_tokens=4 * args.steps + 32, ignore_eos=True)
    vocab = model.config.vocab_size
    for i in range(args.concurrency):
        engine.add_request(f"r{i}", torch.randint(0, vocab, (args.context,)).tolist(), params)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(args.steps):  # warm-up
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) * 1000 / args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    gpu_ms = sum(e.device_time_total for e in events) / 1000 / args.steps
    print(
        f"{torch.cuda.get_device_name()}: c={args.concurrency}, context {args.context}, "
        f"{'eager' if args.eager else 'graphs'}{', async scheduling' * args.async_scheduling}: "
        f"step {step_ms:.2f} ms wall "
        f"({args.concurrency / step_ms * 1000:.0f} tok/s), GPU kernels {gpu_ms:.2f} ms/step "
        f"({100 * gpu_ms / step_ms:.0f}%)"
    )
    for e in events[:25]:
        print(
            f"  {e.device_time_total / 1000 / args.steps:7.3f} ms/step  {e.count // args.steps:5d} calls  "
            f"{e.key[:100]}"
        )
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
