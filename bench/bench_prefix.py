"""A GRPO-shaped workload on the native engine, with and without prefix caching.

    PYTHONPATH=src:bench python bench/bench_prefix.py [--prompts 16] [--group 8] [--prompt-len 1024]
        [--gen-len 512] [--model 0.5b|tiny] [--out results.json]

``prompts`` distinct prompts, each sampled ``group`` times (T=1, ignore EOS), all submitted at
once, in three ways: the group as separate requests with the prefix cache off (the baseline: every
sample prefills its prompt), the same with the cache on (how the orchestrator sends a group: one
request per sample), and one request with ``n=group`` and the cache on. Reported for each: wall
time, output tokens/s, prompt tokens computed (prompt tokens minus cache hits), mean time to first
token and the peak KV blocks held.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def build_model(name: str):
    if name == "0.5b":
        from bench_engine import random_qwen_05b

        return random_qwen_05b()[0]
    from refractor.models import load_model
    from refractor.testing import tiny_qwen2

    return load_model(tiny_qwen2(), dtype=torch.float32, device="cpu")


def run(model, config, prompts, group: int, gen_len: int, as_n: bool) -> dict:
    from refractor.inference.engine import LLMEngine, SamplingParams

    engine = LLMEngine(model, config)
    bm = engine.block_manager
    start = time.monotonic()
    for i, prompt in enumerate(prompts):
        if as_n:
            params = SamplingParams(n=group, temperature=1.0, max_tokens=gen_len, ignore_eos=True, seed=i)
            engine.add_request(f"p{i}", prompt, params)
        else:
            for j in range(group):
                params = SamplingParams(
                    temperature=1.0, max_tokens=gen_len, ignore_eos=True, seed=i * group + j
                )
                engine.add_request(f"p{i}-{j}", prompt, params)
    outputs = []
    peak = 0
    while engine.has_unfinished():
        outputs += engine.step()
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.monotonic() - start
    stats = engine.stats()
    tokens = sum(o.num_generated_tokens for o in outputs)
    result = {
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "output_tokens": tokens,
        "prompt_tokens": stats.prompt_tokens_total,
        "prompt_tokens_computed": stats.prompt_tokens_total - stats.prefix_cache_hits_total,
        "ttft_mean_s": sum(o.first_token_time - start for o in outputs) / len(outputs),
        "peak_kv_blocks": peak,
        "preemptions": stats.num_preemptions_total,
        "steps": stats.steps_total,
    }
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    from refractor.inference.engine import EngineConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--gen-len", type=int, default=512)
    parser.add_argument("--model", default="0.5b" if torch.cuda.is_available() else "tiny")
    parser.add_argument(
        "--rounds", type=int, default=2, help="each mode runs this many times; the best is kept"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    model = build_model(args.model)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)
    ]
    base = {
        "max_model_len": args.prompt_len + args.gen_len + 16,
        "max_num_seqs": max(256, args.prompts * args.group),
    }
    if not torch.cuda.is_available():
        base["kv_cache_memory_gb"] = 0.5
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    results = {"device": device, "args": vars(args), "modes": {}}
    shape = f"{args.prompts} prompts x group {args.group}, {args.prompt_len}+{args.gen_len} tokens"
    print(f"device {device}: {shape}")
    run(model, EngineConfig(**base), prompts[:2], 2, 8, False)  # warm-up (kernels, graphs)
    modes = {
        "separate, no cache": (False, False),
        "separate, cache": (True, False),
        f"n={args.group}, cache": (True, True),
    }
    for name, (caching, as_n) in modes.items():
        config = EngineConfig(**base, enable_prefix_caching=caching)
        rows = [run(model, config, prompts, args.group, args.gen_len, as_n) for _ in range(args.rounds)]
        row = min(rows, key=lambda r: r["seconds"])
        results["modes"][name] = row
        baseline = next(iter(results["modes"].values()))
        print(
            f"{name:20s} {row['tok_s']:9.0f} tok/s  {row['seconds']:6.2f} s  "
            f"prompt tokens computed {row['prompt_tokens_computed']:7d} of {row['prompt_tokens']:7d}  "
            f"TTFT {row['ttft_mean_s'] * 1000:7.1f} ms  peak KV blocks {row['peak_kv_blocks']:6d}  "
            f"x{row['tok_s'] / baseline['tok_s']:.2f} vs {next(iter(results['modes']))}",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
