"""Weight sync: trainer rank 0 -> inference server, the full push (pause -> transfer -> load ->
finish -> prefix reset -> resume) through ``WeightSender``, on the native engine and on vLLM.

Baseline, measured in the same run: the disk round trip every RL stack can do without a transfer
group (the trainer writes safetensors, the server reads them back onto its device and copies them
in; timed in one process, so it omits any process hop and is optimistic). Ratio = baseline / push.
External anchors: TRL 0.18 s (0.6B), verl 0.02 s (7B); refractor's goal: <= 30 ms for 0.5B on a node.

    python bench/bench_weight_sync.py cpu --engines native,vllm --sizes tiny,100m --bucket-mb 16,64,256
    PYTHONPATH=src python bench/bench_weight_sync.py gpu --bucket-mb 64,256,1024    # 2 GPUs, native
    PYTHONPATH=src python bench/bench_weight_sync.py colocated --bucket-mb 64,256  # 1 GPU, both paths

GPU: trainer on GPU 0 holding fp32 master weights of a Qwen2.5-0.5B-shaped model; a native-engine
server process on GPU 1 (bf16); NCCL group. Split: gather (fp32 -> bf16 cast into buckets, what a
single-rank trainer does), transfer (pack + broadcast of every bucket, trainer side), load (the
server's copy into its parameters, reported by the server), push = the whole update incl. HTTP.
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
from refractor.testing import QWEN25_05B_SHAPE, TEST_CONTROL_TOKEN, TinyModelSpec, build_tiny_model
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
def serve_native(model_dir: str, port: int, device: str, random_weights: bool) -> None:
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
    )
    if random_weights:  # Qwen2.5 shapes: initialize on the device instead of writing ~1 GB of safetensors
        engine = LLMEngine(
            build_model(read_hf_config(model_dir), dtype=torch.bfloat16, device=device).eval(), config
        )
    else:
        engine = LLMEngine.from_pretrained(model_dir, config)
    app = create_app(
        AsyncLLMEngine(engine),
        AutoTokenizer.from_pretrained(model_dir),
        "bench",
        control_token=TEST_CONTROL_TOKEN,
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def start_native(model_dir: Path, device: str, random_weights: bool = False, env: dict | None = None):
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


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve-native":
        model_dir, port, device, random_weights = sys.argv[2:6]
        serve_native(model_dir, int(port), device, random_weights == "1")
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="where", required=True)
    cpu = sub.add_parser("cpu")
    cpu.add_argument("--engines", default="native,vllm")
    cpu.add_argument("--sizes", default="tiny,100m")
    cpu.add_argument("--bucket-mb", default="16,64,256")
    cpu.add_argument("--repeats", type=int, default=3)
    gpu = sub.add_parser("gpu")
    gpu.add_argument("--bucket-mb", default="64,256,1024")
    gpu.add_argument("--repeats", type=int, default=5)
    colocated = sub.add_parser("colocated")
    colocated.add_argument("--bucket-mb", default="64,256")
    colocated.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    {"cpu": run_cpu, "gpu": run_gpu, "colocated": run_colocated}[args.where](args)


if __name__ == "__main__":
    main()
