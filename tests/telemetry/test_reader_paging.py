"""The reader's paged timeline and sampled system metrics: walking the pages gives exactly the
unpaged answer (events and rollout spans interleaved, ties on start time included), a page is an
index range, and sampled metrics are the first sample of each series in each slice."""

import bisect
import random
import sqlite3

import pytest

from refractor.records import TimelineEvent
from refractor.telemetry import series
from refractor.telemetry.query import RunReader
from refractor.telemetry.store import RunStore

T0 = 1_000.0


def timeline_events(count: int, seed: int = 0) -> list[TimelineEvent]:
    """Trainer events, tool calls (stay in ``events``) and lifecycle spans (go to ``rollout_spans``),
    on a coarse grid of start times so that many of both kinds share a start."""
    rng = random.Random(seed)
    events = []
    for i in range(count):
        start = T0 + rng.randrange(400) * 0.5
        end = start + rng.choice([0.0, 0.25, 1.0, 7.5])
        kind = rng.randrange(3)
        if kind == 0:
            events.append(TimelineEvent("forward", start, end, "trainer", {"step": i % 7, "i": i}))
        elif kind == 1:
            events.append(TimelineEvent("tool_execution", start, end, "rollout", {"rollout_id": i}))
        else:
            name = rng.choice(["generation", "env_response", "reward"])
            events.append(TimelineEvent(name, start, end, "rollout", {"rollout_id": i, "turn": 0}))
    return events


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("paging") / "run"
    store = RunStore(run_dir)
    events = timeline_events(3000)
    for chunk in range(0, len(events), 500):  # several transactions, ids interleaved in time
        store.log_events(events[chunk : chunk + 500], step=1)
    rng = random.Random(1)
    for tick in range(2000):
        t = T0 + tick * 0.5
        store.log_system_metrics("system", {"cpu": rng.random(), "memory": rng.random()}, t, node="10.0.0.1")
        store.log_system_metrics("system", {"cpu": rng.random()}, t + 0.1, node="10.0.0.2")
        if tick % 3 == 0:  # a slower series
            store.log_system_metrics("inference:server-0", {"cpu": rng.random()}, t + 0.2)
        if 500 <= tick < 900:  # a series that only exists mid-window
            store.log_system_metrics("trainer", {"cpu": rng.random()}, t, node="10.0.0.3")
    store.close()
    return run_dir


def walk(reader: RunReader, page: int, **window) -> list[dict]:
    rows: list[dict] = []
    after = None
    while True:
        got = reader.timeline(**window, after=after, limit=page)
        assert len(got) <= page
        rows += got
        if len(got) < page:
            return rows
        after = (got[-1]["start"], got[-1]["id"])


@pytest.mark.parametrize("page", [1, 7, 500, 5000])
def test_walking_every_page_gives_the_unpaged_timeline_in_order(run_dir, page):
    with RunReader(run_dir) as r:
        whole = r.timeline()
        assert len(whole) == 3000
        assert {e["id"] < 0 for e in whole} == {True, False}  # spans and events both
        assert walk(r, page) == whole


def test_ties_on_start_put_spans_first_then_events_by_id_and_pages_split_them(run_dir):
    with RunReader(run_dir) as r:
        whole = r.timeline()
        keys = [(e["start"], e["id"]) for e in whole]
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
        starts = [e["start"] for e in whole]
        tied = max(set(starts), key=starts.count)
        group = [e for e in whole if e["start"] == tied]
        assert any(e["id"] < 0 for e in group) and any(e["id"] > 0 for e in group)
        # a cursor in the middle of the tie, on a span and on an event
        for cut in range(1, len(group)):
            after = (group[cut - 1]["start"], group[cut - 1]["id"])
            assert r.timeline(after=after, limit=len(group) - cut) == group[cut:]


@pytest.mark.parametrize("component", [None, "rollout", "trainer"])
@pytest.mark.parametrize("page", [1, 13, 400])
def test_window_bounds_and_component_combine_with_paging(run_dir, component, page):
    window = {"start": T0 + 60.0, "end": T0 + 90.0, "component": component}
    with RunReader(run_dir) as r:
        whole = r.timeline(**window)
        assert whole and all(e["end"] >= T0 + 60.0 and e["start"] <= T0 + 90.0 for e in whole)
        assert any(e["start"] < T0 + 60.0 for e in whole)  # events overlapping the left edge
        if component is not None:
            assert {e["component"] for e in whole} == {component}
        assert walk(r, page, **window) == whole
        assert walk(r, page, **window, longest=7.5) == whole


def page_plan(run_dir, **page) -> str:
    """The query plan of the statement one ``timeline`` call runs."""
    statements: list[str] = []
    with RunReader(run_dir) as r:
        r._conn.set_trace_callback(statements.append)
        r.timeline(T0 + 60.0, T0 + 90.0, limit=50, **page)
    (sql,) = [s for s in statements if s.startswith("SELECT id, name")]
    conn = sqlite3.connect(f"file:{run_dir / 'run.db'}?mode=ro", uri=True)
    plan = "\n".join(row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}"))
    conn.close()
    return plan


@pytest.mark.parametrize("page", [{"longest": 7.5}, {"longest": 7.5, "after": (T0 + 70.0, 5)}])
def test_a_page_is_two_bounded_index_ranges_merged_in_order(run_dir, page):
    plan = page_plan(run_dir, **page)
    assert "MERGE (UNION ALL)" in plan
    assert "SEARCH events USING INDEX events_start (start>? AND start<?)" in plan
    assert "SEARCH rollout_spans USING INDEX rollout_spans_start (start>? AND start<?)" in plan
    # a sort of the spans of one start time at a time (their ids run down), never of the whole range
    assert "USE TEMP B-TREE FOR ORDER BY" not in plan
    assert "SCAN" not in plan


def reference_sample(
    rows: list[dict], start: float, end: float, points: int
) -> dict[tuple[str, str, str], list[dict]]:
    """Per series, its first row in each slice of [start, end] (the last slice closed at end)."""
    width = (end - start) / points
    edges = [start + i * width for i in range(1, points)]
    firsts: dict[tuple, dict] = {}
    for row in rows:  # by time, then by the order stored
        if start <= row["time"] <= end:
            key = (row["source"], row["name"], row["node"])
            firsts.setdefault((*key, bisect.bisect_right(edges, row["time"])), row)
    out: dict[tuple[str, str, str], list[dict]] = {}
    for (*key, _), row in firsts.items():
        out.setdefault(tuple(key), []).append(row)
    return out


def by_series(rows: list[dict]) -> dict[tuple[str, str, str], list[dict]]:
    out: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows:
        out.setdefault((row["source"], row["name"], row["node"]), []).append(row)
    return out


@pytest.mark.parametrize(
    ("start", "end", "points", "name"),
    [
        (None, None, 50, None),
        (T0 + 100.0, T0 + 700.0, 37, "cpu"),
        (T0 + 100.0, T0 + 700.0, 5000, "cpu"),
        (T0 + 333.3, T0 + 333.3, 10, None),
    ],
)
def test_sampled_metrics_are_the_first_sample_of_each_series_in_each_slice(run_dir, start, end, points, name):
    with RunReader(run_dir) as r:
        every = r.system_metrics(name=name)
        sampled = r.system_metrics(start, end, name=name, points=points)
    lo = every[0]["time"] if start is None else start
    hi = every[-1]["time"] if end is None else end
    expected = reference_sample(every, lo, hi, points)
    assert by_series(sampled) == expected
    assert all(len(rows) <= points for rows in by_series(sampled).values())
    assert [row["time"] for row in sampled] == sorted(row["time"] for row in sampled)
    if start is not None and start != end:
        assert len(expected) == (4 if name == "cpu" else 5)  # the mid-window series included


def test_without_points_or_paging_the_answers_are_unchanged(run_dir):
    with RunReader(run_dir) as r:
        assert r.system_metrics(T0, T0 + 10.0, name="cpu", points=None) == r.system_metrics(
            T0, T0 + 10.0, name="cpu"
        )
        assert r.timeline(T0, T0 + 10.0, limit=None, after=None) == r.timeline(T0, T0 + 10.0)


def test_the_dashboards_system_series_is_the_readers_sample_by_series(run_dir):
    with RunReader(run_dir) as r:
        got = series.system_series(r, "cpu", T0, T0 + 900.0, points=60)
        sampled = r.system_metrics(T0, T0 + 900.0, name="cpu", points=60)
        short = series.system_series(r, "cpu", T0, T0 + 30.0, points=60)
        every = r.system_metrics(T0, T0 + 30.0, name="cpu")
    assert set(got) == {"system@10.0.0.1", "system@10.0.0.2", "inference:server-0", "trainer@10.0.0.3"}
    assert got["system@10.0.0.2"]["value"] == [
        row["value"] for row in sampled if row["source"] == "system" and row["node"] == "10.0.0.2"
    ]
    assert len(short["system@10.0.0.1"]["time"]) == len([row for row in every if row["node"] == "10.0.0.1"])
