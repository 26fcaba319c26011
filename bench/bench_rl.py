"""End-to-end RL throughput: synchronous (``max_async_rollout: 0``) vs asynchronous (``2``) training.

Runs the real ``refractor train`` driver once per mode in one invocation, on the same machine, with the
native engine: one inference server and one trainer rank, each on a GPU of its own when there are
two, sharing the one GPU otherwise (``colocate: auto``). The model is a random-weight Qwen2.5-0.5B
shape written to disk once; the task is countdown with procedurally generated problems (no
downloads). A random-weight model rarely emits
EOS, so every completion runs to ``max_tokens``: the work per step is fixed and the two modes do
the same amount of generation and training.

Per mode, over the steps after the warm-up ones (read back from the run store, ``run.db``): mean
step time, samples/s and completion tokens/s (kept rollouts per wall-clock second of the measured
steps), trainer and weight-sync time per step, and the idle fraction of each GPU in
``CUDA_VISIBLE_DEVICES``, by nvidia-smi index (NVML utilization sampled every 100 ms while the
measured steps run). The last line prints async/sync.

    PYTHONPATH=src python bench/bench_rl.py --steps 8 --warmup 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def build_model(out: Path, size: str) -> Path:
    """Random weights with the Qwen2.5 shape, saved as a normal HF checkpoint (bf16 safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from refractor.testing import qwen25_shaped

    if (out / "config.json").exists():
        return out
    shape = qwen25_shaped(size, with_weights=False)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(shape).save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


class GpuSampler:
    """NVML utilization of the GPUs in ``CUDA_VISIBLE_DEVICES``, sampled every 100 ms until ``stop``;
    each GPU is named ``gpu<index>`` by its NVML (nvidia-smi) index."""

    def __init__(self) -> None:
        self.handles = {}
        if torch.cuda.is_available():
            import pynvml

            from refractor.telemetry.system import visible_gpu_indices

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in visible_gpu_indices(pynvml)}
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while self.handles and not self._stop.wait(0.1):
            util = [self.nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self.handles.values()]
            self.samples.append((time.time(), util))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def idle_fraction(self, start: float, end: float) -> dict[str, float]:
        """Each GPU's share of the samples between ``start`` and ``end`` it spent idle, by ``gpu<index>``."""
        window = [u for t, u in self.samples if start <= t <= end]
        if not window:
            return {}
        return {
            f"gpu{index}": 1.0 - statistics.fmean(u[i] for u in window) / 100.0
            for i, index in enumerate(self.handles)
        }


def split_modes(text: str) -> list[str]:
    """``--modes`` split at the commas outside brackets, so that YAML flow values such as
    ``evals=[{name: countdown, eval_every: 2}]`` stay whole."""
    modes, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            modes.append(text[start:i])
            start = i + 1
    return [m for m in [*modes, text[start:]] if m]


def parse_mode(token: str) -> tuple[str, int, dict]:
    """``2`` or ``2+weight_sync_inflight_kv=keep+...``: max_async_rollout, then config overrides
    (YAML values)."""
    import yaml

    value, *pairs = token.split("+")
    max_async = int(value)
    overrides = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise SystemExit(f"--modes: {pair!r} in {token!r} is not key=value")
        overrides[key] = yaml.safe_load(raw)
    name = "sync" if max_async == 0 else f"async{max_async}"
    if overrides:
        name += "-" + "-".join(k if isinstance(v, (dict, list)) else f"{k}={v}" for k, v in overrides.items())
    return name, max_async, overrides


def run_mode(
    name: str, max_async: int, args, model: Path, workdir: Path, overrides: dict | None = None
) -> dict:
    gpus = torch.cuda.device_count()
    config = {
        "model": str(model),
        "inference_engine": "native",
        "inference_num_workers": 1,
        "trainer_num_workers": 1,
        "ray_inference_cpus_per_worker": args.cpus,
        "ray_trainer_cpus_per_worker": args.cpus,
        "gpu_memory_utilization": 0.4 if gpus < 2 else 0.85,
        "number_of_steps": args.steps,
        "prompts_batch_size_for_trainer": args.groups,
        "group_size": args.group_size,
        "max_concurrent_prompts_per_server": args.concurrency or args.groups * (max_async + 1),
        "max_async_rollout": max_async,
        "max_off_policy_steps": max(max_async, 1),
        "discard_group_zero_advantage": False,
        "max_tokens": args.max_tokens,
        "max_model_len": args.max_tokens + 512,
        "seq_len": args.seq_len,
        "temperature": 1.0,
        "learning_rate": 1e-6,
        "trainer_compile": args.compile,
        "checkpoint_every": False,
        "metrics_logger_interval_seconds": 0.5,
        "eval_before_training": False,
        "eval_after_training": False,
        "use_wandb": False,
        "run_dir": str(workdir),
        "run_name": name,
        "environments": [{"name": "countdown", "kwargs": {"dataset_name": "procedural"}}],
        **(overrides or {}),
    }
    cfg_path = workdir / f"{name}.json"
    cfg_path.write_text(json.dumps(config))
    cmd = [
        sys.executable,
        "-c",
        "from refractor.cli import app; app()",
        "train",
        "--config",
        str(cfg_path),
        "--quiet",
        "--overwrite",
    ]
    sampler = GpuSampler()
    start = time.time()
    out_path = workdir / f"{name}.out"  # streamed, so a run killed from outside leaves its log
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
        stopped = False
        try:
            proc.wait(timeout=args.mode_timeout or None)
        except subprocess.TimeoutExpired:  # SIGTERM: the driver stops its processes, closes its store
            stopped = True
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    sampler.stop()
    wall = time.time() - start
    log = out_path.read_text(errors="replace")[-6000:]
    if stopped:  # say how far it got (slow or stuck?) and where each process was, then measure it
        times = stored_step_times(workdir / name)
        mean = f", {statistics.fmean(times):.2f} s per step" if times else ""
        print(f"{name}: stopped after --mode-timeout {args.mode_timeout} s; {len(times)} steps stored{mean}")
        for path in sorted((workdir / name / "logs").glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-4:]
            print(f"  {path.name}: " + "\n    ".join(line[:240] for line in tail), flush=True)
        if len(times) <= args.warmup:
            return None
    elif proc.returncode != 0:
        raise SystemExit(f"{name}: refractor train failed ({proc.returncode}):\n{log}")
    return summarize(name, max_async, workdir / name, sampler, args.warmup, wall, started=start)


def kl_text(values: list, keep: int = 12) -> str:
    """Every step's KL, or the first and last few of a long run."""
    words = [f"{k:.2e}" if k is not None else "-" for k in values]
    if len(words) > keep:
        words = [*words[: keep - 3], "...", *words[-3:]]
    return " ".join(words)


def stored_step_times(run_dir: Path) -> list[float]:
    """``timing_step_total`` of every step a run stored (none without a run store)."""
    from refractor.telemetry.query import RunReader

    if not (run_dir / "run.db").is_file():
        return []
    with RunReader(run_dir) as reader:
        return [s["timing_step_total"] for s in reader.step_metrics() if "timing_step_total" in s]


def summarize(
    name: str, max_async: int, run_dir: Path, sampler: GpuSampler, warmup: int, wall: float, started: float
) -> dict:
    """Rates over the measured steps: from the end of the last warm-up step to the end of the last step.
    Also: time from the command to the end of the first step, every step's KL between the engine's and
    the trainer's logprobs, and each process's peak GPU memory (torch's peak per trainer rank and
    native server, NVML's peak per GPU)."""
    from refractor.telemetry.query import RunReader

    with RunReader(run_dir) as reader:
        every = reader.step_metrics()
        steps = [s for s in every if any(not k.startswith("eval/") for k in s if k != "step")]
        if len(steps) <= warmup or warmup < 1:
            raise SystemExit(
                f"{name}: {len(steps)} steps stored; need --warmup >= 1 and more steps than that"
            )
        measured = steps[warmup:]
        kept = [r for s in measured for r in reader.rollouts(step=s["step"], status="kept")]
        ends = reader.step_times()  # each step's metrics are logged when its weight update finished
        t0 = ends[steps[warmup - 1]["step"]]
        t1 = ends[measured[-1]["step"]]
        scraped: dict[str, list[float]] = {}  # the server's /metrics over the measured steps
        for row in reader.system_metrics(t0, t1):
            if row["source"].startswith("inference:"):
                scraped.setdefault(row["name"], []).append(row["value"])
        peaks: dict[str, float] = {}  # GiB, over the whole run
        for metric in ("torch_max_allocated_gb", "torch_reserved_gb", "gpu_memory_used_gb"):
            for row in reader.system_metrics(name=metric):
                key = f"{row['source']}:{metric}"
                peaks[key] = max(peaks.get(key, 0.0), row["value"])
        first_step_s = ends[steps[0]["step"]] - started
        kl = [s.get("kl_divergence_inference") for s in steps]
        evals = {  # eval/<name>/<metric> by step, for runs with `evals:` (eval servers drained and rejoined)
            s["step"]: {k: v for k, v in s.items() if k.startswith("eval/")}
            for s in every
            if any(k.startswith("eval/") for k in s)
        }
        cancelled: dict[str, int] = {}
        for row in reader.rows(
            "SELECT reason, COUNT(*) AS n FROM rollouts WHERE status = 'cancelled' GROUP BY reason"
        ):
            cancelled[row["reason"] or "-"] = row["n"]
    mean = lambda key: statistics.fmean(s.get(key, float("nan")) for s in measured)  # noqa: E731
    return {
        "mode": name,
        "max_async_rollout": max_async,
        "steps_measured": len(measured),
        "wall_s": wall,
        "command_to_first_step_s": first_step_s,
        "kl_divergence_inference": kl,
        "evals": evals,
        "cancelled_by_reason": cancelled,
        "peak_gpu_memory_gb": peaks,
        "step_s": (t1 - t0) / len(measured),
        "samples_per_s": len(kept) / (t1 - t0),
        "tokens_per_s": sum(r["completion_tokens"] for r in kept) / (t1 - t0),
        "train_step_s": mean("timing_train_step"),
        "weight_sync_s": mean("timing_weight_sync_total"),
        "waiting_for_data_s": mean("timing_waiting_for_data"),
        "gpu_idle_fraction": sampler.idle_fraction(t0, t1),
        "server": {
            name: statistics.fmean(scraped[name])
            for name in (
                "requests_running",
                "requests_waiting",
                "engine_busy_fraction",
                "engine_step_ms",
                "generation_tokens_per_s",
            )
            if scraped.get(name)
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="0.5b")
    p.add_argument(
        "--model", default=None, help="an existing model dir instead of a random --size one (CPU dry runs)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="trainer_compile (off by default here: its first-step compile would dominate a short run)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="max_concurrent_prompts_per_server "
        "(0: groups x (max_async_rollout + 1), what each mode can use)",
    )
    p.add_argument("--cpus", type=int, default=4, help="CPUs per server and per trainer rank")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--groups", type=int, default=16, help="prompts_batch_size_for_trainer")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument(
        "--modes",
        default="0,2",
        help="max_async_rollout values to run, in order; each may carry "
        "config overrides: 2+weight_sync_inflight_kv=keep+dispatch_only_needed_groups=true",
    )
    p.add_argument(
        "--mode-timeout",
        type=float,
        default=0,
        help="seconds a mode may run (0: no limit); a stopped mode reports its steps and log tails",
    )
    p.add_argument("--workdir", default="/tmp/refractor_bench_rl")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else build_model(workdir / f"qwen25-{args.size}-random", args.size)
    device = (
        f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    )
    print(
        f"device: {device}; model {args.model or args.size}; "
        f"{args.groups} groups x {args.group_size} samples x {args.max_tokens} tokens per step",
        flush=True,
    )
    results = []
    for name, value, overrides in (parse_mode(t) for t in split_modes(args.modes)):
        r = run_mode(name, value, args, model, workdir, overrides)
        if r is None:  # stopped before its warm-up steps were over: nothing to measure
            continue
        results.append(r)
        idle = ", ".join(f"{gpu} {f:.0%}" for gpu, f in r["gpu_idle_fraction"].items())
        print(
            f"{r['mode']:>7}: step {r['step_s']:.2f} s | {r['samples_per_s']:.1f} samples/s | "
            f"{r['tokens_per_s'] / 1e3:.1f}k tok/s | train {r['train_step_s']:.2f} s "
            f"| sync {r['weight_sync_s']:.3f} s "
            f"| waiting for data {r['waiting_for_data_s']:.2f} s | idle {idle}",
            flush=True,
        )
        print(
            f"{'':>7}  command -> first step {r['command_to_first_step_s']:.1f} s | kl per step "
            + kl_text(r["kl_divergence_inference"]),
            flush=True,
        )
        print(
            f"{'':>7}  peak GPU memory (GiB): "
            + ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["peak_gpu_memory_gb"].items())),
            flush=True,
        )
        for step, metrics in r["evals"].items():
            print(
                f"{'':>7}  eval at step {step}: "
                + ", ".join(f"{k} {v:.3g}" for k, v in sorted(metrics.items()))
            )
        if r["cancelled_by_reason"]:
            print(f"{'':>7}  cancelled rollouts by reason: {r['cancelled_by_reason']}")
        server = r["server"]
        if server:  # how fed the engine was: sequences running, its thread's busy share, its own rate
            print(
                f"{'':>7}  server: {server.get('requests_running', 0):.0f} running, "
                f"{server.get('requests_waiting', 0):.0f} waiting, "
                f"engine busy {server.get('engine_busy_fraction', 0):.0%}, "
                f"step {server.get('engine_step_ms', 0):.1f} ms, "
                f"{server.get('generation_tokens_per_s', 0) / 1e3:.1f}k tok/s",
                flush=True,
            )
    Path(args.out, "bench_rl.json").write_text(json.dumps(results, indent=2))
    if len(results) >= 2:
        base = results[0]
        for r in results[1:]:
            print(
                f"{r['mode']} / {base['mode']}: {r['tokens_per_s'] / base['tokens_per_s']:.2f}x tokens/s, "
                f"step time {base['step_s'] / r['step_s']:.2f}x faster"
            )


if __name__ == "__main__":
    main()
