"""Native engine decode throughput vs HF ``generate`` (GPU), plus GPU correctness checks.

    PYTHONPATH=src python bench/bench_engine.py [--concurrency 64,256] [--prompt-len 128]
        [--gen-len 512] [--hf-gen-len 128] [--skip-checks] [--compare-fused-projections]
        [--compare-lora RANK] [--out results.json]

Workload: random-weight Qwen2.5-0.5B shape (bf16), ``c`` concurrent requests of 128 random
prompt tokens, 512 sampled tokens each (T=1, ignore EOS). Reported per concurrency: output tokens/s
over the whole run and over the decode phase, TTFT, the memory-bandwidth bound of a decode step
(all weights + the KV read and written per step), and HF ``generate`` on the same model and batch
(HF runs fewer new tokens to fit the time budget; its tokens/s only drops with length, so the
ratio is conservative). ``--compare-fused-projections`` runs every concurrency again on an
engine with ``fuse_projections=False`` (separate q/k/v and gate/up GEMMs; the default fuses them)
and prints the ratio. ``--compare-lora RANK`` does the same with runtime LoRA adapters of that rank on
every projection (``lora_sync: adapter``) against the engine without them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import numpy as np
import torch

PEAK_BANDWIDTH_TBS = {"H100": 3.35, "H200": 4.8, "A100": 2.0}


def gpu_checks(log) -> dict:
    """Engine on the GPU vs HF: fp32 greedy equality, bf16 log-prob deviation, graphs vs eager,
    flex vs SDPA."""
    from transformers import AutoModelForCausalLM

    from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams
    from refractor.models import PackedAttention, load_model
    from refractor.models.ops import disable_compiled_ops
    from refractor.testing import tiny_llama, tiny_qwen2, tiny_qwen3

    out: dict = {}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 17, 40, 90)]
    for name, builder in (("qwen2", tiny_qwen2), ("llama", tiny_llama), ("qwen3", tiny_qwen3)):
        path = builder()
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
        for dtype in ("float32", "bfloat16"):
            for eager in (False,):
                engine = LLMEngine.from_pretrained(
                    path,
                    EngineConfig(
                        max_model_len=512,
                        kv_cache_memory_gb=0.05,
                        dtype=dtype,
                        enforce_eager=eager,
                        max_num_seqs=16,
                    ),
                )
                outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
                same = 0
                worst = 0.0
                for prompt, o in zip(prompts, outs, strict=True):
                    ref = hf.generate(
                        torch.tensor([prompt], device="cuda"),
                        max_new_tokens=48,
                        min_new_tokens=48,
                        do_sample=False,
                        pad_token_id=0,
                    )[0, len(prompt) :].tolist()
                    same += ref == o.outputs[0].token_ids
                    full = torch.tensor([prompt + o.outputs[0].token_ids], device="cuda")
                    with torch.no_grad():
                        lp = hf(full).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
                    ref_lp = lp.gather(1, full[0, len(prompt) :, None])[:, 0].cpu()
                    worst = max(worst, (ref_lp - torch.tensor(o.outputs[0].logprobs)).abs().max().item())
                key = f"{name}/{dtype}/{'eager' if eager else 'graphs'}"
                out[key] = {
                    "greedy_equal_hf_fp32": f"{same}/{len(prompts)}",
                    "max_abs_logprob_diff_vs_hf_fp32": worst,
                    "triton_decode": engine.runner.use_triton,
                    "graphs": len(engine.runner.graphs),
                    "compiled_ops": engine.runner.compiled_ops,
                }
                log(f"check {key}: {out[key]}")
                del engine
        if name == "qwen2":  # training path: packed FlexAttention vs SDPA, forward + backward
            disable_compiled_ops()  # the trainer runs the eager ops
            model = load_model(path, device="cuda")
            docs = torch.tensor([0] * 100 + [1] * 200 + [2] * 60 + [-1] * 24, device="cuda")
            pos = torch.cat([torch.arange(n) for n in (100, 200, 60, 24)]).cuda()
            ids = torch.randint(0, 500, (384,), device="cuda")
            results = {}
            for backend in ("flex", "sdpa"):
                model.zero_grad()
                hidden = model(ids, pos, PackedAttention(docs, backend=backend))
                hidden[:360].float().pow(2).mean().backward()
                results[backend] = (
                    hidden.detach(),
                    model.model.layers[0].self_attn.q_proj.weight.grad.clone(),
                )
            out["packed_flex_vs_sdpa"] = {
                "hidden_max_diff": (results["flex"][0] - results["sdpa"][0])[:360].abs().max().item(),
                "padding_rows_max_diff": (results["flex"][0] - results["sdpa"][0])[360:].abs().max().item(),
                "grad_max_diff": (results["flex"][1] - results["sdpa"][1]).abs().max().item(),
            }
            log(f"check packed attention: {out['packed_flex_vs_sdpa']}")
    return out


def random_qwen_05b(dtype=torch.bfloat16):
    from refractor.models import build_model, read_hf_config
    from refractor.testing import qwen25_shaped

    path = qwen25_shaped("0.5b", with_weights=False)
    with torch.device("meta"):
        model = build_model(read_hf_config(path))
    model.to_empty(device="cuda")
    model.init_weights(generator=torch.Generator("cuda").manual_seed(0))
    return model.to(dtype).eval(), path


def bench_hf(path, concurrency: int, prompt_len: int, gen_len: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(path), dtype=torch.bfloat16
        ).eval()
    ids = torch.randint(0, 150000, (concurrency, prompt_len), device="cuda")
    kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, min_new_tokens=gen_len, pad_token_id=0)
    model.generate(ids[:, :16], max_new_tokens=4, **kwargs)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=gen_len, **kwargs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return {"tok_s": concurrency * gen_len / seconds, "seconds": seconds, "new_tokens": gen_len}


def bench_engine(engine, concurrency: int, prompt_len: int, gen_len: int) -> dict:
    from refractor.inference.engine import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=gen_len, ignore_eos=True)
    vocab = engine.model.config.vocab_size
    for i in range(concurrency):
        engine.add_request(f"b{concurrency}-{i}", torch.randint(0, vocab, (prompt_len,)).tolist(), params)
    torch.cuda.synchronize()
    start = time.monotonic()
    outputs = []
    decode_start = None
    steps = 0
    while engine.has_unfinished():
        outputs += engine.step()
        steps += 1
        if decode_start is None and not engine.scheduler.waiting:
            decode_start = time.monotonic()
            decode_tokens_before = engine.generation_tokens_total
    end = time.monotonic()
    tokens = sum(o.num_generated_tokens for o in outputs)
    ttft = [o.first_token_time - start for o in outputs]
    return {
        "tok_s": tokens / (end - start),
        "decode_tok_s": (engine.generation_tokens_total - decode_tokens_before) / (end - decode_start),
        "seconds": end - start,
        "steps": steps,
        "output_tokens": tokens,
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_max_s": max(ttft),
        "preemptions": engine.scheduler.num_preemptions,
    }


def step_breakdown(engine, concurrency: int, prompt_len: int, steps: int = 40) -> dict:
    """Mean ms per decode step spent scheduling, in the model (graph replay + LM head), sampling and
    bookkeeping."""
    from refractor.inference.engine import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"p{i}", torch.randint(0, 1000, (prompt_len,)).tolist(), params)
    while engine.scheduler.waiting:
        engine.step()
    timings = {"schedule": 0.0, "model": 0.0, "sample": 0.0, "total": 0.0}
    for step in range(steps):
        t0 = time.perf_counter()
        seqs, is_prefill = engine.scheduler.schedule()
        t1 = time.perf_counter()
        logits = engine.runner.run(seqs, is_prefill)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        from refractor.inference.engine.sampler import SamplingBatch, step_seeds

        out = engine.sampler(
            logits,
            SamplingBatch(
                [1.0] * len(seqs),
                [1.0] * len(seqs),
                [0] * len(seqs),
                [None] * len(seqs),
                [None] * len(seqs),
                step_seeds(np.arange(len(seqs)), np.full(len(seqs), step)),
            ),
        )
        t3 = time.perf_counter()
        for row, seq in enumerate(seqs):
            seq.append(out.token_ids[row], out.logprobs[row], 0)
        t4 = time.perf_counter()
        for key, value in (
            ("schedule", t1 - t0),
            ("model", t2 - t1),
            ("sample", t3 - t2),
            ("total", t4 - t0),
        ):
            timings[key] += value * 1000 / steps
    engine.abort()
    return timings


def bandwidth_bound(model, concurrency: int, prompt_len: int, gen_len: int, peak_tbs: float) -> dict:
    mc = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2
    mean_context = prompt_len + gen_len / 2
    step_bytes = weight_bytes + concurrency * (mean_context + 1) * kv_per_token
    step_s = step_bytes / (peak_tbs * 1e12)
    return {"step_bytes": step_bytes, "bound_tok_s": concurrency / step_s, "weight_bytes": weight_bytes}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=512)
    parser.add_argument("--hf-gen-len", type=int, default=128)
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--compare-fused-projections", action="store_true")
    parser.add_argument(
        "--compare-split-kv",
        action="store_true",
        help="also run every concurrency with split-KV decode attention off (the baseline)",
    )
    parser.add_argument(
        "--compare-async-scheduling",
        action="store_true",
        help="also run every concurrency with the host a decode step ahead (async_scheduling)",
    )
    parser.add_argument(
        "--compare-lora",
        type=int,
        default=0,
        help="also run every concurrency with runtime LoRA adapters of this rank on every projection",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    def log(msg: str) -> None:
        print(msg, flush=True)

    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BANDWIDTH_TBS.items() if k in name), 3.35)
    results: dict = {"device": name, "torch": torch.__version__, "peak_bandwidth_tbs": peak}
    log(f"device {name}, torch {torch.__version__}")
    if not args.skip_checks:
        try:
            results["checks"] = gpu_checks(log)
        except Exception:
            traceback.print_exc()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    from refractor.testing import qwen25_shaped

    config = qwen25_shaped("0.5b", with_weights=False)
    if not args.skip_hf:
        for c in concurrencies:
            try:
                results[f"hf_{c}"] = bench_hf(config, c, args.prompt_len, args.hf_gen_len)
                log(f"HF generate c={c}: {results[f'hf_{c}']}")
            except Exception:
                traceback.print_exc()

    from refractor.inference.engine import EngineConfig, LLMEngine
    from refractor.models.ops import disable_compiled_ops

    model, _ = random_qwen_05b()
    engine_config = EngineConfig(
        max_model_len=args.prompt_len + args.gen_len + 16,
        max_num_seqs=max(concurrencies),
        gpu_memory_utilization=0.85,
    )
    start = time.perf_counter()
    engine = LLMEngine(model, engine_config)
    results["engine_startup_s"] = time.perf_counter() - start
    results["kv_capacity_tokens"] = engine.runner.kv_capacity_tokens
    results["triton_decode"] = engine.runner.use_triton
    log(
        f"engine ready in {results['engine_startup_s']:.1f}s, "
        f"KV capacity {engine.runner.kv_capacity_tokens} tokens, "
        f"triton={engine.runner.use_triton}, graphs={list(engine.runner.graphs)}"
    )
    bench_engine(engine, 8, args.prompt_len, 16)  # warm-up
    for c in concurrencies:
        r = bench_engine(engine, c, args.prompt_len, args.gen_len)
        r.update(bandwidth_bound(model, c, args.prompt_len, args.gen_len, peak))
        r["pct_of_bandwidth_bound"] = 100 * r["decode_tok_s"] / r["bound_tok_s"]
        if f"hf_{c}" in results:
            r["ratio_vs_hf"] = r["tok_s"] / results[f"hf_{c}"]["tok_s"]
        results[f"engine_{c}"] = r
        log(f"engine c={c}: {json.dumps(r)}")
    c = max(concurrencies)
    results[f"breakdown_ms_{c}"] = step_breakdown(engine, c, args.prompt_len)
    log(f"decode step breakdown c={c} (ms): {results[f'breakdown_ms_{c}']}")
    if args.compare_split_kv:  # the same model, an engine whose decode attention never splits
        from refractor.inference.engine import model_runner

        del engine
        torch.cuda.empty_cache()
        threshold = model_runner.SPLIT_KV_MIN_CONTEXT
        model_runner.SPLIT_KV_MIN_CONTEXT = 1 << 30
        engine = LLMEngine(model, engine_config)
        bench_engine(engine, 8, args.prompt_len, 16)  # warm-up
        for c in concurrencies:
            r = bench_engine(engine, c, args.prompt_len, args.gen_len)
            split = results[f"engine_{c}"]
            r["split_kv_speedup"] = split["tok_s"] / r["tok_s"]
            results[f"engine_no_split_kv_{c}"] = r
            log(
                f"engine without split-KV c={c}: tok/s {r['tok_s']:.0f}; with it {split['tok_s']:.0f} "
                f"({r['split_kv_speedup']:.3f}x)"
            )
        model_runner.SPLIT_KV_MIN_CONTEXT = threshold
        del engine
        torch.cuda.empty_cache()
        engine = LLMEngine(model, engine_config)
    if args.compare_async_scheduling:  # the same model, an engine that launches decode steps ahead
        del engine
        torch.cuda.empty_cache()
        engine = LLMEngine(model, EngineConfig(**{**engine_config.__dict__, "async_scheduling": True}))
        bench_engine(engine, 8, args.prompt_len, 16)  # warm-up
        for c in concurrencies:
            r = bench_engine(engine, c, args.prompt_len, args.gen_len)
            base = results[f"engine_{c}"]
            r["speedup"] = r["tok_s"] / base["tok_s"]
            r["decode_speedup"] = r["decode_tok_s"] / base["decode_tok_s"]
            r["pct_of_bandwidth_bound"] = 100 * r["decode_tok_s"] / base["bound_tok_s"]
            results[f"engine_async_scheduling_{c}"] = r
            log(
                f"engine with async scheduling c={c}: tok/s {r['tok_s']:.0f} ({r['speedup']:.3f}x), "
                f"decode tok/s {r['decode_tok_s']:.0f} ({r['decode_speedup']:.3f}x)"
            )
        del engine
        torch.cuda.empty_cache()
        engine = LLMEngine(model, engine_config)
    if args.compare_fused_projections:  # before the run below turns the compiled ops off
        # a fused engine fused its model in place: a fresh one (the same seed, the same weights)
        del engine, model
        torch.cuda.empty_cache()
        model, _ = random_qwen_05b()
        engine = LLMEngine(model, EngineConfig(**{**engine_config.__dict__, "fuse_projections": False}))
        bench_engine(engine, 8, args.prompt_len, 16)  # warm-up
        for c in concurrencies:
            r = bench_engine(engine, c, args.prompt_len, args.gen_len)
            fused = results[f"engine_{c}"]["decode_tok_s"]
            r["fused_decode_speedup"] = fused / r["decode_tok_s"]
            results[f"engine_separate_projections_{c}"] = r
            log(
                f"engine with separate projections c={c}: decode tok/s {r['decode_tok_s']:.0f}; "
                f"fused {fused:.0f} ({r['fused_decode_speedup']:.3f}x)"
            )
        c = max(concurrencies)
        del engine, model  # the comparison below runs on the default model again
        torch.cuda.empty_cache()
        model, _ = random_qwen_05b()
        engine = LLMEngine(model, engine_config)
    if args.compare_lora:  # lora_sync: adapter; the adapter GEMMs run whatever B holds (zero here)
        del engine, model
        torch.cuda.empty_cache()
        model, _ = random_qwen_05b()
        engine = LLMEngine(model, EngineConfig(**{**engine_config.__dict__, "lora_rank": args.compare_lora}))
        bench_engine(engine, 8, args.prompt_len, 16)  # warm-up
        for c in concurrencies:
            r = bench_engine(engine, c, args.prompt_len, args.gen_len)
            plain = results[f"engine_{c}"]["decode_tok_s"]
            r["lora_decode_ratio"] = r["decode_tok_s"] / plain
            results[f"engine_lora_{c}"] = r
            log(
                f"engine with rank-{args.compare_lora} adapters c={c}: decode tok/s {r['decode_tok_s']:.0f}; "
                f"without {plain:.0f} ({r['lora_decode_ratio']:.3f}x)"
            )
        c = max(concurrencies)
        del engine, model
        torch.cuda.empty_cache()
        model, _ = random_qwen_05b()
        engine = LLMEngine(model, engine_config)
    if engine.runner.compiled_ops:  # the same engine without the fused elementwise ops, for comparison
        del engine
        torch.cuda.empty_cache()
        disable_compiled_ops()
        engine = LLMEngine(model, EngineConfig(**{**engine_config.__dict__, "compile_ops": False}))
        r = bench_engine(engine, c, args.prompt_len, args.gen_len)
        results[f"engine_unfused_{c}"] = r
        log(
            f"engine without compiled ops c={c}: tok/s {r['tok_s']:.0f}, decode tok/s {r['decode_tok_s']:.0f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
