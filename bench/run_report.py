"""What a finished run cost, read back from its run store: the start (each startup instant after
the command, and the end of the first step), every step's time and KL between the engine's and the
trainer's logprobs, throughput after the warm-up steps, peak GPU memory per process and GPU busy.

    PYTHONPATH=src python bench/run_report.py runs/gpu-quickstart --started <unix time> --warmup 2
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from refractor.telemetry.query import RunReader

STARTUP = (
    "orchestrator_start",
    "ray_init_start",
    "ray_init_done",
    "trainer_ready",
    "inference_servers_ready",
    "training_loop_start",
)


def report(run_dir: Path, started: float, warmup: int) -> dict:
    with RunReader(run_dir) as reader:
        steps = reader.step_metrics()
        ends = reader.step_times()
        instants = {e["name"]: e["start"] for e in reader.timeline(component="orchestrator")}
        kept = {s["step"]: reader.rollouts(step=s["step"], status="kept") for s in steps}
        peaks: dict[str, float] = {}
        for metric in ("torch_max_allocated_gb", "gpu_memory_used_gb"):
            for row in reader.system_metrics(name=metric):
                key = f"{row['source']}:{metric}"
                peaks[key] = max(peaks.get(key, 0.0), row["value"])
        measured = steps[warmup:]
        t0, t1 = ends[steps[warmup - 1]["step"]], ends[steps[-1]["step"]]
        busy = [r["value"] for r in reader.system_metrics(t0, t1, name="gpu_utilization_percent")]
    samples = [r for s in measured for r in kept[s["step"]]]
    step_ends = [ends[s["step"]] for s in steps]
    return {
        "startup_s": {name: instants[name] - started for name in STARTUP if name in instants},
        "first_step_s": step_ends[0] - started,
        "step_s": [
            b - a
            for a, b in zip(
                [instants.get("training_loop_start", started), *step_ends[:-1]], step_ends, strict=True
            )
        ],
        "kl_divergence_inference": [s.get("kl_divergence_inference") for s in steps],
        "measured_step_s": (t1 - t0) / len(measured),
        "samples_per_s": len(samples) / (t1 - t0),
        "tokens_per_s": sum(r["completion_tokens"] for r in samples) / (t1 - t0),
        "train_step_s": statistics.fmean(s["timing_train_step"] for s in measured),
        "weight_sync_s": statistics.fmean(s["timing_weight_sync_total"] for s in measured),
        "gpu_busy_percent": statistics.fmean(busy) if busy else None,
        "peak_gpu_memory_gb": peaks,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--started", type=float, required=True, help="unix time the command was started")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    print(json.dumps(report(Path(args.run_dir), args.started, args.warmup), indent=1))


if __name__ == "__main__":
    main()
