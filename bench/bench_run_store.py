"""What recording costs on CPU: the run store writer's throughput, and a quick start's store.

1. Writer: ``--events`` timeline events shaped like rollout lifecycle spans, handed to
   ``RunStore.log_event`` one at a time (as the orchestrator does); the time the caller spends
   handing them over (what the event loop pays) and the time until all are committed.
2. Quick start: ``--steps`` steps of ``configs/examples/quickstart.yaml`` (everything recorded:
   rollouts, lifecycle spans, trainer spans, weight-sync phases, logs, system and server metrics,
   code snapshot); the size of run.db per 1,000 steps, rows per table, and the writer thread's CPU
   time (``meta.store_stats``) against the run's wall time.
3. A/B (``--ab-runs R``): the quick start with everything recorded against ``record_telemetry:
   false`` (no timeline, node/server/torch metrics, log lines or code snapshot in the store), each
   a fresh ``refractor train`` process, alternating R times so drift hits both. Learning rate 0
   keeps every step's work the same (a learning run's completions change length as it learns).
   Steps/s is measured between the metrics of step ``--ab-skip`` and of the last step, leaving the
   start out; the overhead is 1 - (median steps/s recorded) / (median steps/s bare).

    PYTHONPATH=src python bench/bench_run_store.py --events 200000 --steps 20
    PYTHONPATH=src python bench/bench_run_store.py --events 0 --steps 0 --ab-runs 4 --ab-steps 30
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def writer_throughput(events: int, folder: Path) -> None:
    from refractor.records import TimelineEvent
    from refractor.telemetry.store import RunStore

    store = RunStore(folder / "writer", run_name="bench-writer")
    spans = [
        TimelineEvent(
            "generation",
            1000.0 + i,
            1000.5 + i,
            "rollout",
            {
                "rollout_id": i,
                "group_id": i // 16,
                "sample": i % 16,
                "turn": 0,
                "server": "server-0",
                "lane": i % 64,
            },
        )
        for i in range(events)
    ]
    start = time.perf_counter()
    for e in spans:
        store.log_event(e, step=e.attrs["group_id"] // 4)
    handed = time.perf_counter() - start
    store.flush(timeout=3600)
    total = time.perf_counter() - start
    cpu = store.writer_cpu_seconds
    store.close()
    print(
        f"writer: {events} events handed over in {handed:.2f} s ({1e6 * handed / events:.1f} us each, "
        f"{events / handed:,.0f}/s); all committed after {total:.2f} s ({events / total:,.0f} events/s); "
        f"writer thread CPU {cpu:.2f} s"
    )


def quick_start(steps: int, folder: Path) -> None:
    from refractor.config import load_config
    from refractor.train import run_training

    config = ROOT / "configs/examples/quickstart.yaml"
    cfg = load_config(
        config, {"number_of_steps": steps, "run_dir": str(folder / "runs"), "run_name": "bench-store"}
    )
    start = time.perf_counter()
    run_dir = Path(run_training(cfg, quiet=True, config_path=config))
    wall = time.perf_counter() - start
    db = run_dir / "run.db"
    size = sum(p.stat().st_size for p in run_dir.glob("run.db*"))
    conn = sqlite3.connect(db)
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    counts = {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in tables}  # noqa: S608
    stats = conn.execute("SELECT value FROM meta WHERE key = 'store_stats'").fetchone()
    try:  # bytes per table and index (SQLite's dbstat, when compiled in)
        by_table = dict(conn.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").fetchall())
    except sqlite3.Error:
        by_table = {}
    conn.close()
    import json

    stats = json.loads(stats[0]) if stats else {}
    print(f"quick start: {steps} steps in {wall:.1f} s; run.db {size / 2**20:.2f} MiB = "
          f"{size / 2**20 * 1000 / steps:.0f} MiB per 1,000 steps")  # fmt: skip
    print("  rows: " + ", ".join(f"{t} {n}" for t, n in sorted(counts.items()) if n))
    if by_table:
        fixed = sum(v for k, v in by_table.items() if k.startswith(("code_", "sqlite_autoindex_code")))
        per_step = (sum(by_table.values()) - fixed) / steps
        print(
            f"  the code snapshot (once per run) {fixed / 2**20:.2f} MiB; the rest "
            f"{per_step / 2**10:.0f} KiB per step = {per_step * 1000 / 2**20:.0f} MiB per 1,000 steps"
        )
        biggest = sorted(by_table.items(), key=lambda kv: -kv[1])[:8]
        print("  largest: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in biggest))
    cpu = stats.get("writer_cpu_seconds")
    if cpu is not None:
        print(
            f"  writer thread CPU {cpu:.2f} s in {stats['transactions']} transactions = "
            f"{100 * cpu / wall:.2f}% of one core over the run's wall time"
        )


def steps_per_second(run_dir: Path, skip: int) -> float:
    from refractor.telemetry.query import RunReader

    with RunReader(run_dir) as reader:
        times = reader.step_times()
    last = max(times)
    return (last - skip) / (times[last] - times[skip])


def recording_ab(runs: int, steps: int, skip: int, folder: Path) -> None:
    config = ROOT / "configs/examples/quickstart.yaml"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
        "REFRACTOR_ENV_PATH": str(ROOT / "environments"),
    }
    rates: dict[bool, list[float]] = {True: [], False: []}
    for i in range(runs):
        for record in (True, False) if i % 2 == 0 else (False, True):
            name = f"ab-{i}-{'recorded' if record else 'bare'}"
            flags = {
                "run_dir": str(folder / "ab"),
                "run_name": name,
                "number_of_steps": steps,
                "learning_rate": 0.0,
                "ray_address": "",
                "record_telemetry": str(record).lower(),
            }
            cmd = [sys.executable, "-m", "refractor.cli", "train", "--config", str(config), "--quiet"]
            cmd += [part for key, value in flags.items() for part in (f"--{key}", str(value))]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
            run_dir = folder / "ab" / name
            rate = steps_per_second(run_dir, skip)
            size = sum(p.stat().st_size for p in run_dir.glob("run.db*"))
            rates[record].append(rate)
            print(
                f"  {name}: {rate:.3f} steps/s (steps {skip}-{steps - 1}), run.db {size / 2**20:.2f} MiB",
                flush=True,
            )
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(
        f"A/B, {runs} runs each, {steps} steps: recorded median {on:.3f} steps/s "
        f"(min {min(rates[True]):.3f}, max {max(rates[True]):.3f}), bare median {off:.3f} "
        f"(min {min(rates[False]):.3f}, max {max(rates[False]):.3f}); recording costs "
        f"{100 * (1 - on / off):+.1f}% of the steps/s (goal <= 2%)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ab-runs", type=int, default=0, help="A/B pairs of quick starts, recorded vs bare")
    ap.add_argument("--ab-steps", type=int, default=30)
    ap.add_argument("--ab-skip", type=int, default=3, help="steps left out of the steps/s (the start)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.events:
            writer_throughput(args.events, Path(tmp))
        if args.steps:
            quick_start(args.steps, Path(tmp))
        if args.ab_runs:
            recording_ab(args.ab_runs, args.ab_steps, args.ab_skip, Path(tmp))


if __name__ == "__main__":
    main()
