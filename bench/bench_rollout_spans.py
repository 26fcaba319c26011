"""The rollouts' lifecycle spans as ``rollout_spans`` rows (schema 6) against ``events`` rows (schema
5): the bytes of a day-long run's spans, and the dashboard's timeline window over them.

250,000 rollouts over 24 h, each with a ``generation`` span of 0.5-30 s (one in 10,000: 120 s;
with the server's latencies), an ``env_response`` and a ``reward``: 750,000 spans, written once by
the run store's writer and once as the schema-5 writer stored them (JSON ``events`` rows). Each
window is read as the timeline page asks for it (at most 8,000 events, ``min_duration`` a 1500th of
the window), best of 3.

    PYTHONPATH=src python bench/bench_rollout_spans.py
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import tempfile
import time
from pathlib import Path

from refractor.records import TimelineEvent
from refractor.telemetry import series
from refractor.telemetry.query import RunReader
from refractor.telemetry.store import RunStore

T0 = 1.75e9
DAY = 86400.0
LONGEST = 120.1


def day_of_spans(rollouts: int) -> list[TimelineEvent]:
    rng = random.Random(0)
    out = []
    for i in range(rollouts):
        t = T0 + DAY * i / rollouts
        g = 120.0 if i % 10_000 == 0 else rng.uniform(0.5, 30.0)
        ids = {"rollout_id": i, "group_id": i // 16, "sample": i % 16}
        latency = {
            "e2e_latency": g,
            "queue_time": 0.001,
            "ttft": 0.05,
            "decode_time": g - 0.06,
            "prefill_time": 0.01,
        }
        server = {"server": f"server-{i % 8}", "lane": i % 64}
        answer = {"finish_reason": "stop", "completion_tokens": 300}
        out.append(
            TimelineEvent(
                "generation", t, t + g, "rollout", {**ids, "turn": 0, **server, **answer, **latency}
            )
        )
        out.append(TimelineEvent("env_response", t + g, t + g + 0.01, "rollout", {**ids, "turn": 0}))
        out.append(TimelineEvent("reward", t + g + 0.02, t + g + 0.07, "rollout", {**ids, "ok": True}))
    return out


def write_both(spans: list[TimelineEvent], folder: Path) -> dict[str, Path]:
    new = RunStore(folder / "schema6")
    for k in range(0, len(spans), 5000):
        new.log_events(spans[k : k + 5000], step=k // 5000)
    new.close()
    RunStore(folder / "schema5").close()
    conn = sqlite3.connect(folder / "schema5" / "run.db")
    conn.execute("DROP TABLE rollout_spans")
    conn.executemany(
        'INSERT INTO events (name, component, step, start, "end", attrs) VALUES (?,?,?,?,?,?)',
        [(e.name, e.component, 0, e.start, e.end, json.dumps(e.attrs)) for e in spans],
    )
    conn.commit()
    conn.execute("VACUUM")  # both stores as compact as their schema allows
    conn.close()
    conn = sqlite3.connect(folder / "schema6" / "run.db")
    conn.execute("VACUUM")
    conn.close()
    return {"schema5": folder / "schema5", "schema6": folder / "schema6"}


def window_ms(run: Path, start: float, end: float) -> tuple[float, int, bool]:
    with RunReader(run) as r:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            out = series.events_window(r, start, end, LONGEST, limit=8000, min_duration=(end - start) / 1500)
            times.append(time.perf_counter() - t)
    return 1000 * min(times), len(out["events"]["id"]), out["truncated"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=250_000)
    args = ap.parse_args()
    spans = day_of_spans(args.rollouts)
    with tempfile.TemporaryDirectory() as tmp:
        runs = write_both(spans, Path(tmp))
        sizes = {k: (v / "run.db").stat().st_size for k, v in runs.items()}
        print(
            f"{len(spans):,} spans: schema 5 {sizes['schema5'] / 2**20:.0f} MiB, schema 6 "
            f"{sizes['schema6'] / 2**20:.0f} MiB ({sizes['schema6'] / sizes['schema5']:.2f}x)"
        )
        mid = T0 + DAY / 2
        for label, width in (("60 s", 60.0), ("10 min", 600.0), ("2 h", 7200.0), ("24 h", DAY)):
            start = T0 if width == DAY else mid
            old, rows, cut = window_ms(runs["schema5"], start, start + width)
            new, rows_new, cut_new = window_ms(runs["schema6"], start, start + width)
            assert (rows, cut) == (rows_new, cut_new)
            print(
                f"  window {label}: {rows} events{' (truncated)' if cut else ''}: "
                f"schema 5 {old:.0f} ms, schema 6 {new:.0f} ms"
            )


if __name__ == "__main__":
    main()
