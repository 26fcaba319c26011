"""Trainer throughput: refractor's FSDP2 train_step vs a naive HF forward/backward, same GPU, same rows.

Random-weight Qwen2.5-0.5B / 1.5B shapes (config only, weights initialized on the GPU), bf16 compute
(refractor: fp32 master weights + bf16 mixed precision, the config defaults), ~16k real tokens per step
packed first-fit-decreasing into rows of ``--seq-len``. Reports tokens/s (real tokens), MFU
(6 * N * tokens / time / peak dense bf16 FLOPs, N = all parameters, attention FLOPs not counted) and
peak memory. The baseline runs the same packed rows through ``AutoModelForCausalLM`` (sdpa, packed
via position ids) with full fp32 logits, ``log_softmax`` and gather: forward + backward only (no
optimizer), while refractor's time includes the whole step (loss, grad clip, AdamW, LR schedule).

    PYTHONPATH=src python bench/bench_trainer.py --sizes 0.5b,1.5b
    # FSDP over 2 GPUs:
    PYTHONPATH=src torchrun --nproc-per-node 2 bench/bench_trainer.py --tokens 32768 --no-baseline
"""

from __future__ import annotations

import argparse
import builtins
import gc
import json
import os
import time
from pathlib import Path

import torch

DEVICE = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu" only for a dry run of the script itself
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, SXM


def peak_flops() -> float:
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16.items():
        if key in name:
            return value * (756 / 989 if "PCIe" in name and key == "H100" else 1.0)
    return 989e12


def make_samples(num_rows: int, seq_len: int, vocab_size: int, seed: int = 0, fill: float = 0.97):
    """Random-length samples (>= 32 tokens) that first-fit-decreasing packs into ``num_rows`` rows.

    Each row's worth of samples comes from random cuts of ``fill * seq_len`` tokens; seeds are
    tried until FFD (which re-sorts everything) needs exactly ``num_rows`` rows. 25% of each sample
    is prompt; advantages are random.
    """
    from refractor.algorithms.packing import first_fit_decreasing
    from refractor.records import TrainSample

    for attempt in range(1000):
        g = torch.Generator().manual_seed(seed + attempt)
        lengths = []
        for _ in range(num_rows):
            budget = int(fill * seq_len)
            cuts = sorted(
                torch.randint(
                    32, budget - 32, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g
                ).tolist()
            )
            points = [0, *cuts, budget]
            lengths += [b - a for a, b in zip(points, points[1:], strict=False) if b - a >= 32]
        if len(first_fit_decreasing(lengths, seq_len)) == num_rows:
            break
    samples = []
    for i, n in enumerate(lengths):
        p = max(1, n // 4)
        ids = torch.randint(10, vocab_size, (n,), generator=g).tolist()
        samples.append(
            TrainSample(
                ids,
                [0] * p + [1] * (n - p),
                float(torch.randn((), generator=g)),
                [0.0] * p + [-2.0] * (n - p),
                sample_id=i,
            )
        )
    return samples


def timed(fn, steps: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def trainer_settings(model_dir, **overrides):
    """The trainer's settings: the config defaults, a benchmark learning rate and ``overrides``."""
    from refractor.trainer.settings import TrainerSettings

    return TrainerSettings.from_keys(model=str(model_dir), **{"learning_rate": 1e-6, **overrides})


def bench_refractor(
    model_dir,
    batches,
    activation_checkpointing: bool | str,
    warmup: int,
    steps: int,
    export: bool,
    compile: bool | str = False,
    tokens_per_forward: int = 16384,
    profile: str | None = None,
    cpu_offload: bool = False,
    fp8: bool = False,
    learning_rate: float = 1e-6,
    lora_rank: int = 0,
    context_parallel: int = 1,
    stack_projections: bool = False,
    liger: bool = False,
) -> dict:
    """``batches``: one TrainBatch, or several that the steps cycle through (rows of varying length)."""
    from refractor.models import ops
    from refractor.trainer import Trainer, policy_model

    ops.disable_compiled_ops()  # the eager ops, unless this variant swaps in Liger's
    if liger and not ops.enable_liger_ops():
        raise RuntimeError("liger-kernel is not importable")
    torch._dynamo.utils.counters.clear()

    batches = batches if isinstance(batches, list) else [batches]
    policy_model.COMPILE_DYNAMIC = compile == "dynamic"
    policy_model.STACK_PROJECTIONS = stack_projections
    settings = trainer_settings(
        model_dir,
        activation_checkpointing=activation_checkpointing,
        trainer_compile=bool(compile),
        trainer_max_tokens_per_forward=tokens_per_forward,
        fsdp_cpu_offload=cpu_offload,
        fp8=fp8,
        learning_rate=learning_rate,
        lora_rank=lora_rank,
        lora_alpha=2.0 * max(lora_rank, 1),
        fsdp_context_parallel_size=context_parallel,
    )
    trainer = Trainer(settings, random_init=True)
    out: dict = {
        "n_params": sum(p.numel() for p in trainer.model.parameters()),
        "checkpointing": str(trainer.activation_checkpointing).lower(),  # what auto chose
    }
    if lora_rank:  # the weight sync's export: every adapter merged into its projection
        out["merged_export_s"] = time_export(trainer)
    if export:
        # Weight export for sync (256 MiB bf16 buckets): time and peak memory above the resident
        # state; the tensors are kept on the CPU to load the same weights into the HF baseline.
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        weights = {}
        for bucket in trainer.export_weight_buckets(256, torch.bfloat16):
            torch.cuda.synchronize()
            t_copy = time.perf_counter()
            weights.update({name: x.to("cpu") for name, x in bucket})
            t -= time.perf_counter() - t_copy  # the copy to CPU is the benchmark's, not the export's
            del bucket
        torch.cuda.synchronize()
        out["export"] = {
            "time_s": time.perf_counter() - t,
            "bytes": sum(x.numel() * x.element_size() for x in weights.values()),
            "peak_extra_gb": (torch.cuda.max_memory_allocated() - base) / 2**30,
        }
        out["weights"] = weights
        out["export"]["warm_s"] = time_export(trainer)
    curve: list[tuple[float, float]] = []  # (loss, entropy) of every step, warm-up included
    count = iter(range(10**9))
    last = {}

    def step():
        last.update(trainer.train_step(batches[next(count) % len(batches)]).metrics)
        curve.append((last["loss"], last["entropy"]))

    out["first_steps_s"] = []  # wall time of the warm-up steps: compiles show here
    for _ in range(max(warmup, 1)):
        t = time.perf_counter()
        step()
        out["first_steps_s"].append(time.perf_counter() - t)
    out["first_loss"] = curve[0][0]  # before any update: parity with HF
    torch.cuda.reset_peak_memory_stats()

    out["time_s"] = timed(step, steps)
    out["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    out["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    if profile:
        from profile_step import profile_steps

        out["profile"] = profile_steps(step, os.path.dirname(profile), os.path.basename(profile))
    out.update(
        loss=last["loss"],
        grad_norm=last["grad_norm"],
        curve=curve,
        timings={k: v for k, v in last.items() if k.startswith("timing_") and k.endswith("_total")},
    )
    return out


def time_export(trainer, repeats: int = 3) -> float:
    """Best time of a whole export (256 MiB bf16 buckets, tensors dropped at once), warm."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for bucket in trainer.export_weight_buckets(256, torch.bfloat16):
            del bucket
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def bench_export_only(model_dir) -> dict:
    from refractor.trainer import Trainer

    trainer = Trainer(trainer_settings(model_dir, trainer_compile=False), random_init=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    nbytes = 0
    for bucket in trainer.export_weight_buckets(256, torch.bfloat16):
        nbytes += sum(x.numel() * x.element_size() for _, x in bucket)
        del bucket
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    return {
        "time_s": first,
        "warm_s": time_export(trainer),
        "bytes": nbytes,
        "peak_extra_gb": (torch.cuda.max_memory_allocated() - base) / 2**30,
    }


def bench_naive_hf(model_dir, batch, weights, warmup: int, steps: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "sdpa"
    try:
        with torch.device(DEVICE):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except ValueError:  # some transformers versions want accelerate for a device context
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(DEVICE)
    if weights is not None:  # the trainer's initial weights: the first losses must agree
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        model.tie_weights()
    model.train()
    rows = [
        (
            mb.input_ids.to(DEVICE),
            mb.position_ids.to(DEVICE),
            mb.loss_mask.to(DEVICE),
            mb.advantages.to(DEVICE),
        )
        for mb in batch.micro_batches[0]
    ]
    n_tokens = float(sum(float(m.sum()) for _, _, m, _ in rows))
    losses = []

    def step():
        model.zero_grad(set_to_none=True)
        total = 0.0
        for ids, pos, mask, adv in rows:
            logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0].float()
            logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]
            loss = -(logp * adv[1:] * mask[1:]).sum() / n_tokens
            loss.backward()
            total += loss.detach()
        losses.append(total)

    for _ in range(warmup):
        step()
    torch.cuda.reset_peak_memory_stats()
    dt = timed(step, steps)
    return {
        "time_s": dt,
        "peak_gb": torch.cuda.max_memory_allocated() / 2**30,
        "first_loss": float(losses[0]),
    }


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


VARIANTS = {  # name -> (label, activation checkpointing, compiled layers, trainer_max_tokens_per_forward)
    "default": (
        "refractor default (compiled layers, checkpointing auto, 16k-token passes)",
        "auto",
        True,
        16384,
    ),
    "full": ("compiled layers + full ckpt, 16k-token passes", True, True, 16384),
    # the default with q/k/v and gate/up each as one GEMM over stacked weights
    "stacked": ("refractor default + stacked q/k/v and gate/up GEMMs", "auto", True, 16384),
    # fsdp_cpu_offload: parameters, gradients and AdamW state in pinned host memory (16 bytes per
    # parameter of host RAM: a 7B shape needs a machine with ~150 GB)
    "offload": ("compiled layers, checkpointing auto, CPU offload, 16k-token passes", "auto", True, 16384),
    "noac": ("compiled layers, ckpt off, 16k-token passes", False, True, 16384),
    "dyn": (
        "compiled layers (dynamic shapes from the start) + ckpt, 16k-token passes",
        True,
        "dynamic",
        16384,
    ),
    "sac": (
        "compiled layers + selective ckpt (matmul outputs kept), 16k-token passes",
        "selective",
        True,
        16384,
    ),
    # fp8: the decoder projections' GEMMs in float8 through torchao (Hopper/Ada)
    "fp8": ("refractor default + fp8 (float8 projections)", "auto", True, 16384),
    # LoRA rank 64 on every projection, the base frozen in bf16; MFU still counts 6 N per token
    "lora": ("refractor default + LoRA rank 64 (frozen bf16 base)", "auto", True, 16384),
    # Liger-Kernel's Triton RMSNorm, SiLU-gate and rotary in place of the ops Inductor fuses
    "liger": ("refractor default + Liger RMSNorm/SwiGLU/rotary", "auto", True, 16384),
    "liger_eager": ("eager layers + Liger RMSNorm/SwiGLU/rotary, checkpointing auto", "auto", False, 16384),
    "rows": ("compiled layers + ckpt, one pass per 4k row", True, True, 0),
    "rows_noac": ("compiled layers, ckpt off, one pass per 4k row", False, True, 0),
    "eager": ("eager layers + ckpt, 16k-token passes", True, False, 16384),
    "eager_noac": ("eager layers, ckpt off, 16k-token passes", False, False, 16384),
    "eager_rows": ("eager layers + ckpt, one pass per 4k row", True, False, 0),
}
BASELINE = "naive HF fwd+bwd (fp32 logits)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="0.5b,1.5b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--variants", default="default,full,noac,eager_rows", help=f"comma list of {', '.join(VARIANTS)}"
    )
    ap.add_argument(
        "--export-only", action="store_true", help="only time the weight export (256 MiB buckets)"
    )
    ap.add_argument(
        "--vary",
        action="store_true",
        help="cycle 3 batches of 4, 3 and 2 rows whose lengths differ (no baseline)",
    )
    ap.add_argument("--no-baseline", action="store_true", help="skip the naive HF baseline")
    ap.add_argument(
        "--context-parallel",
        type=int,
        default=1,
        help="fsdp_context_parallel_size under torchrun: this many ranks share every row",
    )
    ap.add_argument(
        "--learning-rate",
        type=float,
        default=1e-6,
        help="AdamW learning rate (raise it to compare loss curves, e.g. default vs fp8)",
    )
    ap.add_argument(
        "--model-dir", default=None, help="a config dir to use instead of the Qwen2.5 shapes (dry runs)"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument(
        "--profile", default="", help="comma list of variants to profile (torch.profiler + cProfile, 2 steps)"
    )
    args = ap.parse_args()

    from refractor.algorithms.packing import pack_train_batch
    from refractor.testing import qwen25_shaped

    world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun: FSDP over `world` GPUs, no baseline
    rank0 = int(os.environ.get("RANK", "0")) == 0
    global print
    print = builtins.print if rank0 else (lambda *a, **k: None)  # noqa: A001
    peak = peak_flops() * world
    print(
        f"device {world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"peak bf16 {peak / 1e12:.0f} TFLOP/s"
    )
    results = []
    for size in args.sizes.split(","):
        model_dir = Path(args.model_dir) if args.model_dir else qwen25_shaped(size, with_weights=False)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        samples = make_samples(args.tokens // args.seq_len, args.seq_len, vocab)
        # Rows padded to seq_len: one shape, so compiled kernels (FlexAttention) are reused every row.
        batch = pack_train_batch(
            samples,
            step=0,
            seq_len=args.seq_len,
            pad_to_multiple_of=args.seq_len,
            pad_token_id=0,
            num_dp_ranks=world // args.context_parallel,
        )
        real = sum(len(s.input_ids) for s in samples)
        rows = [[mb.num_tokens for mb in rank_rows] for rank_rows in batch.micro_batches]
        if args.vary:  # realistic rows: lengths differ between steps (padding to 64 only)
            # 4, 3 and 2 rows: with trainer_pass_pad_multiple 4096 the passes are 16k, 12k and 8k tokens
            batches = [
                pack_train_batch(
                    make_samples(
                        max(1, args.tokens // args.seq_len + 1 - k), args.seq_len, vocab, seed=100 * k
                    ),
                    step=k,
                    seq_len=args.seq_len,
                    pad_to_multiple_of=64,
                    pad_token_id=0,
                    num_dp_ranks=world // args.context_parallel,
                )
                for k in range(1, 4)
            ]
            print(
                "   --vary: 3 batches with rows",
                [[mb.num_tokens for mb in b.micro_batches[0]] for b in batches],
            )
            real = sum(
                int(mb.loss_mask.numel() - (mb.document_ids < 0).sum())
                for b in batches
                for r in b.micro_batches
                for mb in r
            ) / len(batches)
        if args.export_only:
            e = bench_export_only(model_dir)
            release()
            print(
                f"== Qwen2.5-{size} weight export: {e['bytes'] / 2**20:.0f} MiB bf16, first call "
                f"{e['time_s'] * 1e3:.1f} ms, warm {e['warm_s'] * 1e3:.1f} ms, "
                f"peak +{e['peak_extra_gb']:.2f} GiB"
            )
            results.append({"size": size, "export": e})
            continue
        print(f"\n== Qwen2.5-{size} shape: {len(samples)} samples, {real} tokens in rows {rows}")
        entry = {"size": size, "tokens": real, "rows": rows}
        batches = batches if args.vary else batch
        weights = None
        labels = []
        for name in args.variants.split(","):
            label, ac, compiled, per_forward = VARIANTS[name]
            t = time.perf_counter()
            try:
                profiled = name in args.profile.split(",")
                prof = os.path.join(args.out, f"profile_{size}_{name}") if profiled else None
                r = bench_refractor(
                    model_dir,
                    batches,
                    ac,
                    args.warmup,
                    args.steps,
                    export=weights is None and not args.vary,
                    compile=compiled,
                    tokens_per_forward=per_forward,
                    profile=prof,
                    cpu_offload=name == "offload",
                    fp8=name == "fp8",
                    learning_rate=args.learning_rate,
                    lora_rank=64 if name == "lora" else 0,
                    context_parallel=args.context_parallel,
                    stack_projections=name == "stacked",
                    liger=name.startswith("liger"),
                )
            except Exception as err:  # report and keep the other variants
                print(f"{label}: failed: {type(err).__name__}: {str(err)[:800]}")
                continue
            finally:
                release()
            weights = r.pop("weights", weights)
            r["tok_s"] = real / r["time_s"]
            r["mfu"] = 6 * r["n_params"] * real / r["time_s"] / peak
            entry[label] = r
            labels.append(label)
            print(
                f"{label}: {r['time_s'] * 1e3:.1f} ms/step, {r['tok_s'] / 1e3:.1f}k tok/s, "
                f"MFU {100 * r['mfu']:.1f}%, peak {r['peak_gb']:.1f} GiB, N={r['n_params'] / 1e6:.0f}M, "
                f"checkpointing {r['checkpointing']}, graph breaks {r['graph_breaks']} "
                f"({time.perf_counter() - t:.0f} s incl. warmup)"
            )
            print(
                "   spans (s):",
                {k[7:-6]: round(v, 4) for k, v in r["timings"].items()},
                f"first-step loss {r['first_loss']:.6f}",
            )
            print("   warm-up steps (s, compiles included):", [round(x, 1) for x in r["first_steps_s"]])
            if "profile" in r:
                print("   profile:", json.dumps(r["profile"]))
            if "merged_export_s" in r:
                print(f"   merged (LoRA) weight export, warm: {r['merged_export_s'] * 1e3:.1f} ms")
            if "export" in r:
                e = r["export"]
                print(
                    f"   weight export: {e['bytes'] / 2**20:.0f} MiB bf16 in {e['time_s'] * 1e3:.0f} ms "
                    f"(warm {e['warm_s'] * 1e3:.1f} ms), "
                    f"peak +{e['peak_extra_gb']:.2f} GiB above the resident state (256 MiB buckets)"
                )
        if "default" in args.variants.split(",") and "fp8" in args.variants.split(","):
            compare_fp8(entry, VARIANTS["default"][0], VARIANTS["fp8"][0])
        if not args.no_baseline and not args.vary and world == 1:
            base = bench_naive_hf(model_dir, batch, weights, max(1, args.warmup - 1), args.steps)
            release()
            base["tok_s"] = real / base["time_s"]
            n_params = entry[labels[0]]["n_params"] if labels else 0
            base["mfu"] = 6 * n_params * real / base["time_s"] / peak
            entry[BASELINE] = base
            print(
                f"naive HF fwd+bwd: {base['time_s'] * 1e3:.1f} ms/step, {base['tok_s'] / 1e3:.1f}k tok/s, "
                f"MFU {100 * base['mfu']:.1f}%, peak {base['peak_gb']:.1f} GiB"
            )
            if labels:
                first = entry[labels[0]]["first_loss"]
                ref = base["first_loss"]
                print(
                    f"loss parity on identical weights (step 1, before the update): refractor {first:.6f} vs "
                    f"HF {ref:.6f} (rel diff {abs(first - ref) / max(abs(ref), 1e-9):.1e})"
                )
            for label in labels:
                r = entry[label]
                print(
                    f"ratio {label} / naive: {r['tok_s'] / base['tok_s']:.2f}x throughput, "
                    f"{base['peak_gb'] / r['peak_gb']:.2f}x less peak memory"
                )
        results.append(entry)
        if rank0:
            save(results, args.out)


def compare_fp8(entry: dict, default: str, fp8: str) -> None:
    """fp8 against the default on the same batches: throughput, memory, and the per-step loss and
    entropy curves (the relative gap of each step, largest over the run)."""
    if default not in entry or fp8 not in entry:
        return
    base, r = entry[default], entry[fp8]
    print(
        f"ratio fp8 / default: {r['tok_s'] / base['tok_s']:.2f}x throughput, "
        f"{base['peak_gb'] / r['peak_gb']:.2f}x less peak memory"
    )
    for i, metric in enumerate(("loss", "entropy")):
        ours = [step[i] for step in r["curve"]]
        ref = [step[i] for step in base["curve"]]
        scale = max(abs(x) for x in ref) or 1.0  # a loss crosses zero: gaps relative to its largest value
        gaps = [abs(a - b) / max(abs(b), 1e-9) for a, b in zip(ours, ref, strict=True)]
        scaled = [abs(a - b) / scale for a, b in zip(ours, ref, strict=True)]
        print(
            f"   {metric} over {len(ref)} steps: default {ref[0]:.5f} -> {ref[-1]:.5f}, fp8 {ours[0]:.5f} -> "
            f"{ours[-1]:.5f}; max relative gap {max(gaps):.2e} (step {gaps.index(max(gaps)) + 1}), "
            f"max gap / largest |{metric}| {max(scaled):.2e}"
        )


def save(results: list[dict], out: str) -> None:
    with open(os.path.join(out, "bench_trainer.json"), "w") as f:
        json.dump(results, f, indent=1, default=float)


if __name__ == "__main__":
    main()
