"""Sleep mode of the native engine on a GPU (random Qwen2.5-0.5B shape, bf16, CUDA graphs).

How long ``sleep`` and ``wake_up`` take at each level, how much GPU memory a sleep gives back (the
driver's free memory before and after), and that sleep mode costs nothing while awake: decode
throughput of the engine built without sleep mode (the baseline), of the sleep-mode engine before
any sleep and after several (ratios printed), and greedy tokens equal before and after the sleeps.

    PYTHONPATH=src:bench python bench/bench_sleep.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

GiB = 1 << 30


def free_gib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / GiB


def decode_tok_s(engine, concurrency: int, prompt_len: int, gen_len: int) -> float:
    from bench_engine import bench_engine

    return bench_engine(engine, concurrency, prompt_len, gen_len)["decode_tok_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()

    from bench_engine import random_qwen_05b

    from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams

    model, _ = random_qwen_05b()
    host_weights = {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}
    config = EngineConfig(
        max_model_len=args.prompt_len + args.gen_len + 16,
        max_num_seqs=args.concurrency,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    # the baseline: the same engine without sleep mode (plain tensors, caching allocator)
    plain = LLMEngine(model, config)
    decode_tok_s(plain, 32, args.prompt_len, 32)  # warm-up
    runs = [decode_tok_s(plain, args.concurrency, args.prompt_len, args.gen_len) for _ in range(3)]
    plain_tok_s = statistics.median(runs)
    print(
        f"plain engine: KV {plain.runner.kv_capacity_tokens} tokens; decode {plain_tok_s:,.0f} tok/s "
        f"(median of {[round(r) for r in runs]})",
        flush=True,
    )
    del plain, runs
    torch.cuda.empty_cache()
    before_build = free_gib()
    engine = LLMEngine(model, replace(config, enable_sleep_mode=True))
    held = (engine.runner.kv_memory.nbytes + engine.memory.weights.memory.nbytes) / GiB
    print(
        f"engine: KV {engine.runner.kv_memory.nbytes / GiB:.2f} GiB + weights "
        f"{engine.memory.weights.memory.nbytes / GiB:.2f} GiB, graphs {len(engine.runner.graphs)}, "
        f"took {before_build - free_gib():.2f} GiB",
        flush=True,
    )
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = [
        torch.randint(0, 150000, (args.prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(8)
    ]
    tokens_before = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
    decode_tok_s(engine, 32, args.prompt_len, 32)  # warm-up
    runs = [decode_tok_s(engine, args.concurrency, args.prompt_len, args.gen_len) for _ in range(3)]
    baseline = statistics.median(runs)
    print(
        f"decode before any sleep: {baseline:,.0f} tok/s (median of {[round(r) for r in runs]})", flush=True
    )

    print(
        f"sleep-mode engine: KV {engine.runner.kv_capacity_tokens} tokens; "
        f"decode {baseline / plain_tok_s:.3f}x the plain engine's",
        flush=True,
    )
    results: dict = {
        "held_gib": held,
        "plain_decode_tok_s": plain_tok_s,
        "baseline_decode_tok_s": baseline,
        "levels": {},
    }
    for level in (1, 2):
        rows = []
        for _ in range(args.rounds):
            awake = free_gib()
            t0 = time.perf_counter()
            engine.sleep(level)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            freed = free_gib() - awake
            t2 = time.perf_counter()
            engine.wake_up(["weights"])
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            refill = 0.0
            if level == 2:  # what a weight sync does after the wake, from host memory here
                engine.update_weights(host_weights.items(), recompute_kv=False)
                torch.cuda.synchronize()
                refill = time.perf_counter() - t3
            t4 = time.perf_counter()
            engine.wake_up(["kv_cache"])
            torch.cuda.synchronize()
            t5 = time.perf_counter()
            rows.append(
                {
                    "sleep_s": t1 - t0,
                    "wake_weights_s": t3 - t2,
                    "refill_s": refill,
                    "wake_kv_s": t5 - t4,
                    "freed_gib": freed,
                }
            )
        summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        results["levels"][level] = {"median": summary, "rounds": rows}
        print(
            f"level {level}: sleep {summary['sleep_s'] * 1e3:.1f} ms, wake weights "
            f"{summary['wake_weights_s'] * 1e3:.1f} ms (+ refill {summary['refill_s'] * 1e3:.1f} ms), "
            f"wake KV {summary['wake_kv_s'] * 1e3:.1f} ms; "
            f"freed {summary['freed_gib']:.2f} of {held:.2f} GiB held",
            flush=True,
        )
    tokens_after = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
    runs = [decode_tok_s(engine, args.concurrency, args.prompt_len, args.gen_len) for _ in range(3)]
    after = statistics.median(runs)
    print(f"decode after: median of {[round(r) for r in runs]}", flush=True)
    results |= {
        "greedy_equal": tokens_after == tokens_before,
        "after_decode_tok_s": after,
        "ratio": after / baseline,
    }
    print(
        f"after {2 * args.rounds} sleeps: greedy tokens equal: {tokens_after == tokens_before}; decode "
        f"{after:,.0f} tok/s = {after / baseline:.3f}x the baseline",
        flush=True,
    )
    Path(args.out, "bench_sleep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
