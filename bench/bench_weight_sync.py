"""Weight sync: trainer rank 0 -> inference server, the full push (pause -> transfer -> load ->
finish -> prefix reset -> resume) through ``WeightSender``, on the native engine and on vLLM.

Baseline, measured in the same run: the disk round trip every RL stack can do without a transfer
group (the trainer writes safetensors, the server reads them back onto its device and copies them
in; timed in one process, so it omits any process hop and is optimistic). Ratio = baseline / push.
External anchors: TRL 0.18 s (0.6B), verl 0.02 s (7B); refractor's goal: <= 30 ms for 0.5B on a node.

    python bench/bench_weight_sync.py cpu --engines native,vllm --sizes tiny,100m --bucket-mb 16,64,256
    PYTHONPATH=src python bench/bench_weight_sync.py gpu --bucket-mb 64,256,1024    # 2 GPUs, native
    PYTHONPATH=src python bench/bench_weight_sync.py colocated --bucket-mb 64,256  # 1 GPU, both paths
    PYTHONPATH=src python bench/bench_weight_sync.py colocated --lora-rank 64 --sizes 0.5b,7b  # 1 GPU
    python bench/bench_weight_sync.py cpu --lora-rank 8 --sizes tiny   # the same LoRA comparison on CPU

GPU: trainer on GPU 0 holding fp32 master weights of a Qwen2.5-0.5B-shaped model; a native-engine
server process on GPU 1 (bf16); NCCL group. Split: gather (fp32 -> bf16 cast into buckets, what a
single-rank trainer does), transfer (pack + broadcast of every bucket, trainer side), load (the
server's copy into its parameters, reported by the server), push = the whole update incl. HTTP.

LoRA (``--lora-rank R``, ``run_lora``): the push of a real single-rank ``Trainer`` through its own
export (``export_weight_buckets``) in each of ``--lora-modes``: ``full`` (no adapters, fp32 master
weights cast to the server's dtype), ``merged`` (``lora_sync: merged``: frozen base with every
adapter merged in, the same bytes as full) and ``adapter`` (``lora_sync: adapter``: A, B and the
scale only; the server applies them at run time). One native server with adapter buffers of rank R
takes all three (a weight push leaves its buffers alone). Colocated: trainer and server on one GPU,
buckets as CUDA IPC handles; ``cpu``: the same code over gloo. push = wall time of one
``WeightSender.push`` fed by the export (the export streams into the transfer, nothing gathered
before the pause), until the server loaded it and the canary passed; median of ``--repeats`` warm
pushes. On one 80 GB GPU the 7B shape peaks with the full mode's trainer: fp32 master weights (~30 GB)
beside the server's bf16 copy (~15 GB) and its 0.5 GB KV cache; the LoRA trainers hold a bf16 base.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from refractor.inference.vllm.launcher import free_port
from refractor.testing import (
    QWEN25_05B_SHAPE,
    TEST_CONTROL_TOKEN,
    TinyModelSpec,
    build_tiny_model,
    qwen25_shaped,
)
from refractor.weight_sync import ServerRef, WeightSender, WeightSyncSettings, iter_buckets

SIZES = {
    "tiny": TinyModelSpec(),
    # ~100M parameters (24.6M embedding + 12 x 6.3M layers), bf16: ~200 MB on the wire
    "100m": TinyModelSpec(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        torch_dtype="bfloat16",
    ),
}


# --- the native server (this script re-invoked as a subprocess) ----------------------------------
def serve_native(model_dir: str, port: int, device: str, random_weights: bool, lora_rank: int = 0) -> None:
    import uvicorn
    from transformers import AutoTokenizer

    from refractor.inference.engine import EngineConfig, LLMEngine
    from refractor.inference.engine.async_engine import AsyncLLMEngine
    from refractor.inference.server import create_app  # mounts the weight-update routes
    from refractor.models import build_model, read_hf_config

    config = EngineConfig(
        max_model_len=1024,
        max_num_seqs=8,
        kv_cache_memory_gb=0.5 if device == "cuda" else 0.05,
        dtype="bfloat16" if device == "cuda" else "float32",
        device=device,
        enforce_eager=True,
        lora_rank=lora_rank,  # runtime adapter buffers on every projection (the trainer's default targets)
    )
    if random_weights:  # Qwen2.5 shapes: initialize on the device instead of writing ~1 GB of safetensors
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        engine = LLMEngine(build_model(read_hf_config(model_dir), dtype=dtype, device=device).eval(), config)
    else:
        engine = LLMEngine.from_pretrained(model_dir, config)
    app = create_app(
        AsyncLLMEngine(engine),
        AutoTokenizer.from_pretrained(model_dir),
        "bench",
        control_token=TEST_CONTROL_TOKEN,
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def start_native(
    model_dir: Path, device: str, random_weights: bool = False, env: dict | None = None, lora_rank: int = 0
):
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "serve-native",
            str(model_dir),
            str(port),
            device,
            "1" if random_weights else "0",
            str(lora_rank),
        ],
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the native server on {url} did not start")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)


# --- measurements -------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def disk_baseline(named: list[tuple[str, torch.Tensor]], device: torch.device, repeats: int) -> float:
    from safetensors.torch import load_file, save_file

    targets = {n: torch.empty_like(t, device=device) for n, t in named}
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    times = []
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        for _ in range(repeats):
            start = time.perf_counter()
            save_file({n: t.detach().to("cpu").contiguous() for n, t in named}, f"{tmp}/model.safetensors")
            loaded = load_file(f"{tmp}/model.safetensors", device=str(device))
            for name, tensor in loaded.items():
                targets[name].copy_(tensor)
            sync(device)
            times.append(time.perf_counter() - start)
    return min(times)


def time_pushes(sender: WeightSender, named, bucket_bytes: int, repeats: int, version: int) -> dict:
    results = []
    for i in range(repeats + 1):  # the first push also sends the metadata and warms up: not counted
        result = sender.push(iter_buckets(named, bucket_bytes), version=version + i)
        if i:
            results.append(result)
    best = min(results, key=lambda r: r.paused_seconds)
    (report,) = next(iter(best.reports.values()))
    return {
        "push_s": best.paused_seconds,
        "median_push_s": statistics.median(r.paused_seconds for r in results),
        "transfer_s": best.transfer_seconds,
        "load_s": report.load_us / 1e6,
        "buckets": best.stats.buckets,
        "mbytes": best.stats.bytes / 2**20,
    }


def row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


# --- CPU: native + vLLM, sizes x bucket sizes ------------------------------------------------------
def run_cpu(args) -> None:
    from refractor.models import iter_safetensors

    print(
        row(
            [
                "engine",
                "model",
                "MiB",
                "bucket",
                "buckets",
                "push (best)",
                "push (median)",
                "transfer",
                "load",
                "disk baseline",
                "ratio",
            ]
        )
    )
    print(row(["---"] * 11))
    version = 1
    for size in args.sizes.split(","):
        model_dir = build_tiny_model(SIZES[size])
        named = list(iter_safetensors(model_dir))
        baseline = disk_baseline(named, torch.device("cpu"), args.repeats)
        for engine in args.engines.split(","):
            if engine == "native":
                process, url = start_native(model_dir, "cpu")
                stop = process.kill
            else:
                from refractor.inference.vllm.launcher import VllmServerSettings, start_vllm_server

                server = start_vllm_server(
                    model_dir,
                    settings=VllmServerSettings(
                        max_model_len=1024,
                        kv_cache_memory_gb=0.25,
                        max_num_seqs=8,
                        extra_env={"VLLM_CPU_CI_ENV": "1"},
                    ),
                )
                url = server.url
                stop = server.stop
            sender = WeightSender(
                [ServerRef(f"{engine}-0", url)],
                WeightSyncSettings(
                    control_token=TEST_CONTROL_TOKEN,
                    init_timeout_s=120,
                    timeout_s=300,
                    gather_before_pause_bytes=0,
                ),
            )
            try:
                for bucket_mb in (int(b) for b in args.bucket_mb.split(",")):
                    r = time_pushes(sender, named, bucket_mb << 20, args.repeats, version)
                    version += args.repeats + 1
                    print(
                        row(
                            [
                                engine,
                                size,
                                f"{r['mbytes']:.1f}",
                                f"{bucket_mb} MiB",
                                r["buckets"],
                                ms(r["push_s"]),
                                ms(r["median_push_s"]),
                                ms(r["transfer_s"]),
                                ms(r["load_s"]),
                                ms(baseline),
                                f"{baseline / r['push_s']:.2f}x",
                            ]
                        ),
                        flush=True,
                    )
            finally:
                sender.close()
                stop()


# --- GPU: native engine on a second GPU, NCCL ----------------------------------------------------
def run_gpu(args) -> None:
    from refractor.models import build_model, read_hf_config

    n_gpus = torch.cuda.device_count()
    print(f"GPUs: {n_gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    if n_gpus < 2:
        raise SystemExit("the GPU benchmark needs 2 GPUs (NCCL cannot put two ranks on one GPU)")
    model_dir = build_tiny_model(QWEN25_05B_SHAPE, with_weights=False)
    process, url = start_native(model_dir, "cuda", random_weights=True, env={"CUDA_VISIBLE_DEVICES": "1"})
    device = torch.device("cuda:0")
    try:
        master = build_model(
            read_hf_config(model_dir), dtype=torch.float32, device=device
        )  # trainer fp32 weights
        params = list(master.named_parameters())
        print(
            f"model: Qwen2.5-0.5B shape, {sum(p.numel() for _, p in params) / 1e6:.0f}M params, "
            f"{sum(p.numel() for _, p in params) * 2 / 2**20:.0f} MiB in bf16"
        )
        sender = WeightSender(
            [ServerRef("native-gpu1", url)],
            WeightSyncSettings(
                control_token=TEST_CONTROL_TOKEN,
                init_timeout_s=120,
                timeout_s=120,
                gather_before_pause_bytes=0,
            ),
            device=device,
        )
        start = time.perf_counter()
        sender.init()
        print(f"group init (NCCL rendezvous): {ms(time.perf_counter() - start)}")
        print(
            row(
                [
                    "bucket",
                    "buckets",
                    "gather",
                    "transfer",
                    "load",
                    "push (best)",
                    "push (median)",
                    "push streamed (gather overlapped)",
                    "disk baseline",
                    "ratio",
                    "goal 30 ms",
                ]
            )
        )
        print(row(["---"] * 11))
        version = 1
        baseline = None
        for bucket_mb in (int(b) for b in args.bucket_mb.split(",")):
            gathers = []
            for _ in range(3):
                sync(device)
                start = time.perf_counter()
                buckets = list(
                    iter_buckets(((n, p.detach().to(torch.bfloat16)) for n, p in params), bucket_mb << 20)
                )
                sync(device)
                gathers.append(time.perf_counter() - start)
            if baseline is None:
                baseline = disk_baseline([pair for b in buckets for pair in b], device, 2)
            r = time_pushes(
                sender, [pair for b in buckets for pair in b], bucket_mb << 20, args.repeats, version
            )
            version += args.repeats + 1
            streamed = []
            for _ in range(args.repeats):
                result = sender.push(
                    iter_buckets(((n, p.detach().to(torch.bfloat16)) for n, p in params), bucket_mb << 20),
                    version=version,
                )
                version += 1
                streamed.append(result.paused_seconds)
            best_streamed = min(streamed)
            print(
                row(
                    [
                        f"{bucket_mb} MiB",
                        r["buckets"],
                        ms(min(gathers)),
                        ms(r["transfer_s"]),
                        ms(r["load_s"]),
                        ms(r["push_s"]),
                        ms(r["median_push_s"]),
                        ms(best_streamed),
                        ms(baseline),
                        f"{baseline / best_streamed:.1f}x",
                        "met" if best_streamed <= 0.030 else "missed",
                    ]
                ),
                flush=True,
            )
        sender.close()
    finally:
        process.kill()
        process.wait()


# --- colocated: the native engine on the trainer's GPU, host staging against CUDA IPC ---------------
def run_colocated(args) -> None:
    """One GPU holds the trainer's fp32 master weights and a native-engine server process (bf16), as
    in a colocated run. The same pushes through host memory over gloo (the baseline: what colocated
    runs did first) and as CUDA IPC handles over gloo, one after the other against the same server."""
    from refractor.models import build_model, read_hf_config

    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    model_dir = build_tiny_model(QWEN25_05B_SHAPE, with_weights=False)
    process, url = start_native(model_dir, "cuda", random_weights=True, env={"CUDA_VISIBLE_DEVICES": "0"})
    device = torch.device("cuda:0")
    try:
        master = build_model(read_hf_config(model_dir), dtype=torch.float32, device=device)
        params = list(master.named_parameters())
        print(
            f"model: Qwen2.5-0.5B shape, {sum(p.numel() for _, p in params) / 1e6:.0f}M params, "
            f"{sum(p.numel() for _, p in params) * 2 / 2**20:.0f} MiB in bf16; server on the same GPU"
        )
        print(
            row(
                [
                    "path",
                    "bucket",
                    "buckets",
                    "transfer",
                    "load",
                    "push (best)",
                    "push (median)",
                    "vs host staging",
                ]
            )
        )
        print(row(["---"] * 8))
        version = 1
        best: dict[int, float] = {}
        for path, ipc in (("host staging (gloo)", False), ("CUDA IPC handles", True)):
            sender = WeightSender(
                [ServerRef("native-gpu0", url)],
                WeightSyncSettings(
                    cpu_staging=True,
                    cuda_ipc=ipc,
                    control_token=TEST_CONTROL_TOKEN,
                    init_timeout_s=120,
                    timeout_s=120,
                    gather_before_pause_bytes=0,
                ),
                device=device,
            )
            sender.init()
            for bucket_mb in (int(b) for b in args.bucket_mb.split(",")):
                buckets = list(
                    iter_buckets(((n, p.detach().to(torch.bfloat16)) for n, p in params), bucket_mb << 20)
                )
                r = time_pushes(
                    sender, [pair for b in buckets for pair in b], bucket_mb << 20, args.repeats, version
                )
                version += args.repeats + 1
                ratio = "1.0x (baseline)" if not ipc else f"{best[bucket_mb] / r['push_s']:.1f}x faster"
                best.setdefault(bucket_mb, r["push_s"])
                print(
                    row(
                        [
                            path,
                            f"{bucket_mb} MiB",
                            r["buckets"],
                            ms(r["transfer_s"]),
                            ms(r["load_s"]),
                            ms(r["push_s"]),
                            ms(r["median_push_s"]),
                            ratio,
                        ]
                    ),
                    flush=True,
                )
            sender.close()
    finally:
        process.kill()


# --- LoRA: adapter push vs merged push vs full push, one device ---------------------------------------
LORA_MODES = ("full", "merged", "adapter")


def lora_model_dir(size: str) -> Path:
    """Config + tokenizer only: trainer and server initialize random weights on their device."""
    if size in SIZES:
        return build_tiny_model(SIZES[size], with_weights=False)
    if size in ("0.5b", "7b"):
        return qwen25_shaped(size, with_weights=False)
    raise SystemExit(f"--sizes: {size!r} is not one of {', '.join(SIZES)}, 0.5b, 7b")


def lora_trainer(model_dir: Path, device: str, mode: str, rank: int):
    """A single-rank ``Trainer`` as a run builds it: full fine-tuning (fp32 master weights), or a frozen
    base in the compute dtype with rank-``rank`` adapters exported as ``lora_sync: mode``. Every B is
    set to small random values (a fresh adapter's B is zero), so merged weights differ from the base
    and the server's adapters change its outputs."""
    from torch.distributed.tensor import DTensor

    from refractor.models.lora import lora_modules
    from refractor.trainer import Trainer
    from refractor.trainer.settings import TrainerSettings

    keys = {"lora_rank": rank, "lora_alpha": 2.0 * rank, "lora_sync": mode} if mode != "full" else {}
    settings = TrainerSettings.from_keys(
        model=str(model_dir), learning_rate=1e-6, trainer_compile=False, **keys
    )
    trainer = Trainer(settings, device=device, random_init=True)
    generator = torch.Generator(device=trainer.device).manual_seed(1)
    with torch.no_grad():
        for _, module in lora_modules(trainer.model):
            b = module.lora_B.weight
            b = b.to_local() if isinstance(b, DTensor) else b  # one rank: its shard is the whole tensor
            b.copy_(torch.randn(b.shape, generator=generator, device=b.device, dtype=b.dtype) * 1e-3)
    return trainer


def gpu_memory_gb(device: torch.device) -> str:
    """The whole card's memory in use (every process: trainer and server), as torch sees it."""
    if device.type != "cuda":
        return "-"
    free, total = torch.cuda.mem_get_info(device)
    return f"{(total - free) / 2**30:.1f} / {total / 2**30:.0f} GiB"


def time_lora_mode(sender: WeightSender, trainer, bucket_mb: int, dtype, repeats: int, version: int) -> dict:
    """One warm-up push, then ``repeats`` timed ones: each from the trainer's export to the server's
    load and the canary (``push`` raises ``CanaryError`` when a server did not get exactly what was
    sent or left a parameter unwritten); then the export alone, as often."""
    device = trainer.device
    walls, results = [], []
    for i in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        result = sender.push(trainer.export_weight_buckets(bucket_mb, dtype), version=version + i)
        sync(device)
        if i:  # the first push warms up (allocations, the server's first load): not counted
            walls.append(time.perf_counter() - start)
            results.append(result)
    exports = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for bucket in trainer.export_weight_buckets(bucket_mb, dtype):
            del bucket
        sync(device)
        exports.append(time.perf_counter() - start)
    reports = [report for r in results for reps in r.reports.values() for report in reps]
    stats = results[-1].stats
    return {
        "push_median_s": statistics.median(walls),
        "push_min_s": min(walls),
        "push_s": walls,
        "paused_median_s": statistics.median(r.paused_seconds for r in results),
        "export_median_s": statistics.median(exports),
        "transfer_median_s": statistics.median(r.transfer_seconds for r in results),
        "load_median_s": statistics.median(rep.load_us / 1e6 for rep in reports),
        "bytes": stats.bytes,
        "tensors": stats.tensors,
        "buckets": stats.buckets,
        "params_written": f"{reports[-1].params_loaded}/{reports[-1].params_total}",
        "canary": "passed",  # every push above returned, so every canary passed
    }


def run_lora(args, device_type: str) -> dict:
    """Every ``--lora-modes`` push of every ``--sizes`` model against one server (module docstring).
    Prints a table per size and the ratios adapter / merged and adapter / full of the median pushes."""
    import gc
    import json

    modes = [m for m in args.lora_modes.split(",") if m]
    unknown = sorted(set(modes) - set(LORA_MODES))
    if unknown or not modes:
        raise SystemExit(f"--lora-modes: {', '.join(unknown) or 'none'} not of {', '.join(LORA_MODES)}")
    if args.lora_rank <= 0:
        raise SystemExit(f"--lora-rank must be positive, got {args.lora_rank}")
    cuda = device_type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("colocated --lora-rank needs a GPU (use `cpu --lora-rank` for the CPU path)")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # the server's dtype (serve_native)
    where = (
        f"GPU: {torch.cuda.get_device_name(device)}, trainer and server on it, buckets as CUDA IPC handles"
        if cuda
        else "CPU: trainer and server processes, buckets over gloo"
    )
    print(
        f"{where}; torch {torch.__version__}; LoRA rank {args.lora_rank} (alpha {2 * args.lora_rank}) "
        f"on every projection; {args.bucket_mb} MiB buckets; median of {args.repeats} warm pushes"
    )
    out: dict = {"device": where, "lora_rank": args.lora_rank, "bucket_mb": args.bucket_mb, "sizes": {}}
    version = 1
    for size in args.sizes.split(","):
        model_dir = lora_model_dir(size)
        process, url = start_native(model_dir, device_type, random_weights=True, lora_rank=args.lora_rank)
        sender = WeightSender(
            [ServerRef(f"native-{device_type}", url)],
            WeightSyncSettings(
                cpu_staging=cuda,
                cuda_ipc=cuda,
                control_token=TEST_CONTROL_TOKEN,
                init_timeout_s=120,
                timeout_s=300,
                gather_before_pause_bytes=0,  # the export streams into the transfer: one measured path
            ),
            device=device,
        )
        rows: dict[str, dict] = {}
        try:
            sender.init()
            print(f"\n{size} ({model_dir.name})")
            header = [
                "mode",
                "MiB moved",
                "tensors",
                "buckets",
                "push (median)",
                "push (min)",
                "paused (median)",
                "export alone",
                "transfer",
                "load",
                "written",
                "canary",
                "GPU in use",
            ]
            print(row(header))
            print(row(["---"] * len(header)))
            for mode in modes:
                trainer = lora_trainer(model_dir, device_type, mode, args.lora_rank)
                r = time_lora_mode(sender, trainer, args.bucket_mb, dtype, args.repeats, version)
                version += args.repeats + 1
                r["gpu_in_use"] = gpu_memory_gb(device)  # with this mode's trainer still held
                r["params"] = trainer.num_parameters
                rows[mode] = r
                del trainer
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                print(
                    row(
                        [
                            mode,
                            f"{r['bytes'] / 2**20:.1f}",
                            r["tensors"],
                            r["buckets"],
                            ms(r["push_median_s"]),
                            ms(r["push_min_s"]),
                            ms(r["paused_median_s"]),
                            ms(r["export_median_s"]),
                            ms(r["transfer_median_s"]),
                            ms(r["load_median_s"]),
                            r["params_written"],
                            r["canary"],
                            r["gpu_in_use"],
                        ]
                    ),
                    flush=True,
                )
        finally:
            sender.close()
            process.kill()
            process.wait()
        ratios = {}
        for other in ("merged", "full"):
            if "adapter" in rows and other in rows:
                a, o = rows["adapter"], rows[other]
                ratios[f"adapter/{other}"] = {
                    "push": a["push_median_s"] / o["push_median_s"],
                    "bytes": a["bytes"] / o["bytes"],
                }
                print(
                    f"{size}: adapter / {other}: push {ratios[f'adapter/{other}']['push']:.3f}x "
                    f"({ms(a['push_median_s'])} / {ms(o['push_median_s'])}), "
                    f"bytes {ratios[f'adapter/{other}']['bytes']:.4f}x"
                )
        out["sizes"][size] = {"modes": rows, "ratios": ratios}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_weight_sync_lora.json").write_text(json.dumps(out, indent=1))
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve-native":
        model_dir, port, device, random_weights, lora_rank = sys.argv[2:7]
        serve_native(model_dir, int(port), device, random_weights == "1", int(lora_rank))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="where", required=True)
    cpu = sub.add_parser("cpu")
    cpu.add_argument("--engines", default=None, help="default native,vllm; with --lora-rank native")
    cpu.add_argument("--sizes", default=None, help="default tiny,100m; with --lora-rank tiny")
    cpu.add_argument("--bucket-mb", default=None, help="default 16,64,256; with --lora-rank one size, 256")
    cpu.add_argument("--repeats", type=int, default=3)
    add_lora_options(cpu)
    gpu = sub.add_parser("gpu")
    gpu.add_argument("--bucket-mb", default="64,256,1024")
    gpu.add_argument("--repeats", type=int, default=5)
    colocated = sub.add_parser("colocated")
    colocated.add_argument("--bucket-mb", default=None, help="default 64,256; with --lora-rank one size, 256")
    colocated.add_argument("--repeats", type=int, default=5)
    colocated.add_argument("--sizes", default="0.5b,7b", help="with --lora-rank: of tiny, 100m, 0.5b, 7b")
    add_lora_options(colocated)
    args = parser.parse_args()
    lora = getattr(args, "lora_rank", 0) != 0
    defaults = {  # (without LoRA, with --lora-rank)
        "cpu": {
            "engines": ("native,vllm", "native"),
            "sizes": ("tiny,100m", "tiny"),
            "bucket_mb": ("16,64,256", "256"),
        },
        "colocated": {"bucket_mb": ("64,256", "256")},
    }
    for key, choices in defaults.get(args.where, {}).items():
        if getattr(args, key) is None:
            setattr(args, key, choices[lora])
    if lora:
        if args.where == "cpu" and args.engines != "native":
            raise SystemExit("cpu --lora-rank: adapter pushes need the native engine (--engines native)")
        if len(args.bucket_mb.split(",")) != 1:
            raise SystemExit(f"--lora-rank takes one --bucket-mb, got {args.bucket_mb}")
        args.bucket_mb = int(args.bucket_mb)
        run_lora(args, "cuda" if args.where == "colocated" else "cpu")
        return
    {"cpu": run_cpu, "gpu": run_gpu, "colocated": run_colocated}[args.where](args)


def add_lora_options(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--lora-rank", type=int, default=0, help="compare LoRA pushes of this rank (0: the full-push tables)"
    )
    sub.add_argument(
        "--lora-modes", default=",".join(LORA_MODES), help="with --lora-rank: some of full,merged,adapter"
    )
    sub.add_argument("--out", default=None, help="with --lora-rank: write bench_weight_sync_lora.json here")


if __name__ == "__main__":
    main()
