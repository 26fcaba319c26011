"""The rollouts' lifecycle spans stored as typed rows (schema 6) read back as the events they were
written as, through the reader and the dashboard's timeline window; a store from before them (the
spans in ``events``) reads the same and takes new spans when a run writes to it again."""

import asyncio
import json
import sqlite3

import pytest

from refractor.orchestrator.lifecycle import RolloutEvents
from refractor.records import TimelineEvent
from refractor.telemetry import rollout_spans, series
from refractor.telemetry.query import RunReader
from refractor.telemetry.store import SCHEMA_VERSION, RunStore

LATENCY = {
    "e2e_latency": 0.1886300369988021,
    "queue_time": 0.0004227029985486297,
    "ttft": 0.03,
    "decode_time": 0.15,
    "prefill_time": 0.0296,
}


def lifecycle_spans(first_id: int, t0: float) -> list[TimelineEvent]:
    """What the orchestrator's lifecycle code records for a finished rollout, a cancelled one and a
    reward that raised, plus a tool call and a trainer span (both stay in ``events``)."""
    recorded: list[TimelineEvent] = []
    clock = iter(t0 + 0.25 * i for i in range(100))
    events = RolloutEvents(recorded.append, lambda: next(clock))
    base = {"rollout_id": first_id, "group_id": 3, "sample": 1}
    with events.span("generation", **base, turn=0, server="server-0", lane=5) as span:
        span.update(finish_reason="length", completion_tokens=8)
        span.update(LATENCY)
    with events.span("env_response", **base, turn=0):
        pass
    events.add("tool_execution", t0 + 0.6, t0 + 0.7, **base, turn=0, tool_call=0, tool="calc", success=True)
    with events.span("reward", **base) as span:
        span["ok"] = True
        span["note"] = "an attribute without a column"
    cancelled = {"rollout_id": first_id + 1, "group_id": 3, "sample": 2}
    with (
        pytest.raises(asyncio.CancelledError),
        events.span("generation", **cancelled, turn=0, server="server-1", lane=0),
    ):
        raise asyncio.CancelledError
    with pytest.raises(ValueError), events.span("reward", **cancelled):
        raise ValueError("reward function failed")
    recorded.append(TimelineEvent("forward", t0, t0 + 2.0, "trainer", {"step": 4, "rank": 0}))
    return recorded


def expected(events: list[TimelineEvent], step: int) -> list[dict]:
    rows = [
        {
            "name": e.name,
            "component": e.component,
            "step": e.attrs.get("step", step),
            "start": e.start,
            "end": e.end,
            "attrs": e.attrs,
        }
        for e in events
    ]
    return sorted(rows, key=lambda r: r["start"])


def read_back(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in ("name", "component", "step", "start", "end", "attrs")} for r in rows]


def rounded(rows: list[dict]) -> list[dict]:
    """Floats to microseconds, as latencies are stored."""
    return json.loads(json.dumps(rows), parse_float=lambda text: round(float(text), 6))


def window_rows(reader: RunReader, start: float, end: float) -> list[dict]:
    cols = series.events_window(reader, start, end, longest=10.0)["events"]
    return [
        {k: (json.loads(cols[k][i]) if k == "attrs" else cols[k][i]) for k in cols if k != "id"}
        for i in range(len(cols["id"]))
    ]


def test_lifecycle_spans_read_back_as_the_events_they_were_written_as(tmp_path):
    spans = lifecycle_spans(10, 1000.0)
    store = RunStore(tmp_path / "run")
    store.log_events(spans, step=2)
    store.close()
    with RunReader(tmp_path / "run") as r:
        stored = {row["name"] for row in r.rows("SELECT name FROM events")}
        assert stored == {"tool_execution", "forward"}  # the lifecycle spans are typed rows
        assert r.rows("SELECT COUNT(*) AS n FROM rollout_spans")[0]["n"] == 5
        timeline = r.timeline()
        assert rounded(read_back(timeline)) == rounded(expected(spans, 2))
        assert len({row["id"] for row in timeline}) == len(timeline)
        assert rounded(read_back(r.timeline(component="rollout"))) == rounded(
            [e for e in expected(spans, 2) if e["component"] == "rollout"]
        )
        assert [e["name"] for e in r.timeline(component="trainer")] == ["forward"]
        forward, cancelled = r.timeline(1001.3, 1001.6)
        assert forward["name"] == "forward" and cancelled["name"] == "generation"
        assert cancelled["attrs"]["outcome"] == "cancelled" and cancelled["attrs"]["server"] == "server-1"
        assert rounded(window_rows(r, 999.0, 1010.0)) == rounded(expected(spans, 2))
        wide = series.events_window(r, 0.0, 5000.0, 10.0, min_duration=0.25, wide=1.0)["events"]
        assert wide["name"] == ["generation", "forward", "env_response", "reward", "generation", "reward"]


def test_a_zoomed_out_timeline_reads_the_long_rollout_spans_by_their_own_index(tmp_path):
    long = {"rollout_id": 1, "group_id": 0, "sample": 0, "turn": 0, "server": "server-0", "lane": 0}
    store = RunStore(tmp_path / "run")
    store.log_events(lifecycle_spans(10, 1000.0), step=2)
    store.log_events([TimelineEvent("generation", 1003.0, 1004.5, "rollout", long)], step=2)
    store.close()
    with RunReader(tmp_path / "run") as r:
        plan = r.rows(
            f"EXPLAIN QUERY PLAN SELECT id FROM rollout_spans WHERE {rollout_spans.LONG} AND start > 0"
        )
        assert any("rollout_spans_long" in row["detail"] for row in plan)
        for min_duration in (1.0, 0.99):  # by the partial index, and by the start index
            window = series.events_window(r, 0.0, 5000.0, 10.0, min_duration=min_duration, wide=1.0)
            assert window["events"]["name"] == ["forward", "generation"]
            assert json.loads(window["events"]["attrs"][1]) == long


def test_a_store_with_the_spans_in_events_reads_the_same_and_takes_new_spans_when_written_again(tmp_path):
    old = lifecycle_spans(10, 1000.0)
    run = tmp_path / "run"
    RunStore(run).close()
    conn = sqlite3.connect(run / "run.db")  # a version-5 store: every span in events
    conn.execute("DROP TABLE rollout_spans")
    conn.executemany(
        'INSERT INTO events (name, component, step, start, "end", attrs) VALUES (?,?,?,?,?,?)',
        [(e.name, e.component, e.attrs.get("step", 2), e.start, e.end, json.dumps(e.attrs)) for e in old],
    )
    conn.execute("UPDATE meta SET value = '5' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with RunReader(run) as r:
        assert not r.has_table("rollout_spans")
        assert read_back(r.timeline()) == expected(old, 2)
        assert window_rows(r, 999.0, 1010.0) == expected(old, 2)
    new = lifecycle_spans(20, 2000.0)
    store = RunStore(run)  # a resume
    store.log_events(new, step=3)
    store.close()
    with RunReader(run) as r:
        assert r.meta()["schema_version"] == SCHEMA_VERSION
        assert rounded(read_back(r.timeline())) == rounded(expected(old, 2) + expected(new, 3))
        assert rounded(window_rows(r, 1999.0, 2010.0)) == rounded(expected(new, 3))
