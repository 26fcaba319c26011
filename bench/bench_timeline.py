"""What recording the trainer's timeline costs on a GPU, and what a GPU run leaves in the run store.

One trainer (Qwen2.5-0.5B shape, random weights, the config defaults: fp32 master, bf16 compute),
the same packed rows every step. Steps alternate between ``track_gpu_events: true`` (a CUDA event
around every span, one synchronize per step) and ``false`` (the whole step by the wall clock) on
two trainers built alike, so drift in clocks or temperature hits both; the overhead is the median
of the per-round ratios of their step times (also printed: the ratio of medians and of minima).
``--control`` builds both trainers without CUDA-event spans (A/A), to show what the two instances
alone differ by. Meanwhile the run store of this process records what a run records on
a GPU: every step's spans (with rank, node, GPU), NVML and psutil metrics every second
(``NodeSampler``), and torch memory every 0.1 s (``TorchMemoryRecorder``); the script reads the
store back and prints what it holds.

    PYTHONPATH=src python bench/bench_timeline.py --steps 20 --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import threading
import time
from pathlib import Path

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="0.5b")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per setting")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--control",
        action="store_true",
        help="A/A: both trainers without CUDA-event spans, to see what the two instances differ by alone",
    )
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument(
        "--model-dir", default=None, help="a small model dir instead of the Qwen2.5 shape (CPU dry run)"
    )
    args = ap.parse_args()

    from bench_trainer import make_samples, trainer_settings

    from refractor.algorithms.packing import pack_train_batch
    from refractor.telemetry.query import RunReader
    from refractor.telemetry.store import RunStore
    from refractor.telemetry.system import NodeSampler
    from refractor.telemetry.torch_memory import TorchMemoryRecorder, torch_memory_gb
    from refractor.testing import qwen25_shaped
    from refractor.trainer import Trainer

    device = torch.device(os.environ.get("BENCH_DEVICE", "cuda"))  # "cpu": a dry run of the script
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}")
    model_dir = Path(args.model_dir) if args.model_dir else qwen25_shaped(args.size, with_weights=False)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    samples = make_samples(args.tokens // args.seq_len, args.seq_len, vocab)
    batch = pack_train_batch(
        samples, step=0, seq_len=args.seq_len, pad_to_multiple_of=args.seq_len, pad_token_id=0, num_dp_ranks=1
    )
    run_dir = Path(args.out) / "timeline-run"
    store = RunStore(run_dir, config={"bench": "timeline"}, run_name="bench-timeline")
    node = "127.0.0.1"

    sampler = NodeSampler.open()
    stop = threading.Event()

    def sample_node() -> None:
        while not stop.wait(1.0):
            rows: dict[str, dict[str, float]] = {}
            for source, name, value in sampler.sample():
                rows.setdefault(source, {})[name] = value
            for source, metrics in rows.items():
                store.log_system_metrics(source, metrics, node=node)

    memory = TorchMemoryRecorder(lambda: torch_memory_gb(device), 0.1)
    node_thread = threading.Thread(target=sample_node, daemon=True)
    node_thread.start()
    memory.start()

    trainers = {}
    for detail in (True, False):
        trainers[detail] = Trainer(
            trainer_settings(model_dir, track_gpu_events=detail and not args.control, trainer_compile=False),
            random_init=True,
            device=None if device.type == "cuda" else device,  # None: this rank's own cuda:<i>
        )
        trainers[detail].timeline_attrs = {"node": node, "gpu": "0"}
    times: dict[bool, list[float]] = {True: [], False: []}
    step = 0
    for i in range(args.warmup + args.steps):
        for detail in (True, False) if i % 2 == 0 else (False, True):
            sync(device)
            t = time.perf_counter()
            result = trainers[detail].train_step(dataclasses.replace(batch, step=step))
            sync(device)
            if i >= args.warmup:
                times[detail].append(time.perf_counter() - t)
            store.log_step_metrics(step, result.metrics)
            store.log_events(result.timeline, step=step)
            step += 1
    stop.set()
    memory.stop()
    for t, metrics in memory.drain():
        store.log_system_metrics("torch:trainer-0", metrics, t, node=node)
    store.close("finished")

    label = {True: "second trainer, false" if args.control else "track_gpu_events true", False: "false"}
    for detail in (True, False):
        v = sorted(times[detail])
        print(
            f"step time, {label[detail]}: median {1e3 * statistics.median(v):.1f} ms, mean "
            f"{1e3 * statistics.fmean(v):.1f}, min {1e3 * v[0]:.1f}, max {1e3 * v[-1]:.1f} ({len(v)} steps)"
        )
    # each round runs both trainers back to back: the ratio within a round leaves drift out
    ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
    print(
        f"overhead ({label[True]} vs {label[False]}): median of per-round ratios "
        f"{100 * (statistics.median(ratios) - 1):+.2f}%, of medians "
        f"{100 * (statistics.median(times[True]) / statistics.median(times[False]) - 1):+.2f}%, of minima "
        f"{100 * (min(times[True]) / min(times[False]) - 1):+.2f}%"
    )
    with RunReader(run_dir) as reader:
        events = reader.timeline()
        names = sorted({e["name"] for e in events})
        print(f"run store: {len(events)} trainer events, span names {names}")
        sample = next(e for e in events if e["name"] == "forward")
        print(
            f"a forward span: {json.dumps(sample['attrs'])}, {1e3 * (sample['end'] - sample['start']):.2f} ms"
        )
        metrics = reader.system_metrics()
        sources = sorted({r["source"] for r in metrics})
        print(f"system metrics: {len(metrics)} rows from sources {sources}")
        for name in ("gpu_utilization_percent", "gpu_memory_used_gb", "gpu_power_w", "torch_allocated_gb"):
            values = [r["value"] for r in metrics if r["name"] == name]
            if values:
                print(f"  {name}: {len(values)} samples, max {max(values):.1f}")
        stats = next(m for m in reader.step_metrics() if "timing_forward_microbatch_mean" in m)
        print(
            "microbatch statistics of a detailed step: "
            + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in stats.items() if "forward_microbatch" in k)
        )
    print(f"run.db: {(run_dir / 'run.db').stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
