"""What recording costs on CPU: the run store writer's throughput, and a quick start's store.

1. Writer: ``--events`` timeline events shaped like rollout lifecycle spans, handed to
   ``RunStore.log_event`` one at a time (as the orchestrator does); the time the caller spends
   handing them over (what the event loop pays) and the time until all are committed.
2. Quick start: ``--steps`` steps of ``configs/examples/quickstart.yaml`` (everything recorded:
   rollouts, lifecycle spans, trainer spans, weight-sync phases, logs, system and server metrics,
   code snapshot); the size of run.db per 1,000 steps, rows per table, and the writer thread's CPU
   time (``meta.store_stats``) against the run's wall time.

    PYTHONPATH=src python bench/bench_run_store.py --events 200000 --steps 20
"""

from __future__ import annotations

import argparse
import sqlite3
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        writer_throughput(args.events, Path(tmp))
        if args.steps:
            quick_start(args.steps, Path(tmp))


if __name__ == "__main__":
    main()
