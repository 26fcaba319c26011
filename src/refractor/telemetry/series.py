"""Series over steps and over wall time, bounded in size for a dashboard: step metrics by name
(and their catalogue), timeline events in a time window, the inference lanes' rollouts in a time
window, and system metrics sampled to a number of points."""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from refractor.telemetry import rollout_spans
from refractor.telemetry.query import RunReader


@dataclass(frozen=True)
class MetricName:
    """A step metric's name split as ``section/group/metric`` (2 parts: ``section//metric``;
    one part: a plain metric, section '')."""

    name: str
    section: str
    group: str
    metric: str

    @classmethod
    def parse(cls, name: str) -> MetricName:
        parts = name.split("/")
        if len(parts) == 1:
            return cls(name, "", "", name)
        if len(parts) == 2:
            return cls(name, parts[0], "", parts[1])
        return cls(name, parts[0], parts[1], "/".join(parts[2:]))


def metric_names(reader: RunReader) -> list[str]:
    """Every step metric name, sorted. With the ``step_metrics_by_name`` index (schema 4) this seeks
    from one name to the next instead of reading every row."""
    if reader.has_index("step_metrics_by_name"):
        sql = """
            WITH RECURSIVE names(name) AS (
                SELECT MIN(name) FROM step_metrics
                UNION ALL
                SELECT (SELECT MIN(name) FROM step_metrics WHERE name > names.name)
                FROM names WHERE names.name IS NOT NULL)
            SELECT name FROM names WHERE name IS NOT NULL"""
    else:
        sql = "SELECT DISTINCT name FROM step_metrics ORDER BY name"
    return [r["name"] for r in reader.rows(sql)]


def metric_series(
    reader: RunReader, names: list[str], since: int | None = None
) -> dict[str, dict[str, list[float | None]]]:
    """{name: {"steps": [...], "values": [...]}} for each name (steps after ``since`` only)."""
    out: dict[str, dict[str, list[Any]]] = {n: {"steps": [], "values": []} for n in names}
    if not names:
        return out
    sql = f"SELECT name, step, value FROM step_metrics WHERE name IN ({','.join('?' * len(names))})"
    args: list[Any] = list(names)
    if since is not None:
        sql += " AND step > ?"
        args.append(since)
    got = reader.columns(sql + " ORDER BY name, step", args)
    begin = 0
    column = got["name"]
    while begin < len(column):  # rows come sorted by name: cut the columns at each new name
        name = column[begin]
        end = bisect.bisect_right(column, name, lo=begin)
        out[name] = {"steps": got["step"][begin:end], "values": got["value"][begin:end]}
        begin = end
    return out


# first and last system-metric time; two subqueries, as SQLite reads a MIN or a MAX from an index
# (one seek) only when the query asks for that one aggregate
SYSTEM_TIME_EDGES = (
    "SELECT (SELECT MIN(time) FROM system_metrics) AS lo, (SELECT MAX(time) FROM system_metrics) AS hi"
)


def max_after(reader: RunReader, table: str, expr: str, key: str, after: int) -> tuple[float | None, int]:
    """The largest ``expr`` over the rows whose ``key`` (an increasing id) is past ``after``, and
    the last id: a running maximum over append-only rows reads only the new ones."""
    row = reader.rows(f"SELECT MAX({expr}) AS v, MAX({key}) AS last FROM {table} WHERE {key} > ?", (after,))[
        0
    ]
    return row["v"], row["last"] if row["last"] is not None else after


def time_bounds(reader: RunReader, timeline_end: float | None) -> dict[str, float | None]:
    """First and last wall time of the run's timeline (events and rollouts; the caller keeps the
    last end, a running maximum: see :func:`max_after`) and of its system metrics, by index seeks
    (None where the run has none)."""
    starts = []
    for table in ("events", "rollout_spans"):
        if reader.has_table(table):
            starts.append(reader.rows(f"SELECT MIN(start) AS t FROM {table}")[0]["t"])  # noqa: S608
    if reader.has_table("rollouts"):
        starts.append(
            reader.rows("SELECT MIN(dispatch_time) AS t FROM rollouts WHERE dispatch_time > 0")[0]["t"]
        )
    starts = [t for t in starts if t is not None]
    out: dict[str, float | None] = {"start": min(starts) if starts else None, "end": timeline_end}
    out["system_start"] = out["system_end"] = None
    if reader.has_table("system_metrics"):
        row = reader.rows(SYSTEM_TIME_EDGES)[0]
        out["system_start"], out["system_end"] = row["lo"], row["hi"]
    return out


def step_times(reader: RunReader) -> dict[int, float]:
    """When each training step's metrics were logged, read from ``policy_version`` (logged every
    step; one index range) or, without it, from every training metric."""
    rows = reader.rows("SELECT step, time FROM step_metrics WHERE name = 'policy_version'")
    if rows:
        return {r["step"]: r["time"] for r in rows}
    return reader.step_times()


# instants a zoomed-out timeline still shows (the others are too many to tell apart)
MILESTONES = (
    "training_loop_start",
    "save_batch",
    "weight_update",
    "checkpoint_save_start",
    "checkpoint_save_done",
    "train_time_budget_reached",
)


def events_window(
    reader: RunReader,
    start: float,
    end: float,
    longest: float,
    limit: int = 20_000,
    min_duration: float = 0.0,
    wide: float = 1800.0,
) -> dict[str, Any]:
    """Events overlapping [start, end], by start time, at most ``limit`` (``truncated`` says so),
    as columns, the rollouts' lifecycle spans (``rollout_spans``, schema 6) among them. An event
    overlapping the window started at most ``longest`` (the longest event's or span's duration)
    before it, so the ``events_start`` and ``rollout_spans_start`` indexes bound the scan. With
    ``min_duration`` (about a pixel of the view) shorter spans and instants other than milestones
    and evals are left out; a window wider than ``wide`` seconds then reads the long events and the
    milestones by the ``events_duration`` and ``events_name`` indexes (schema 4) instead of every
    event in it, and a ``min_duration`` of a second or more reads only the long rollout spans
    (``rollout_spans_long``), none when ``min_duration`` is over ``longest``."""
    cols = 'id, name, component, step, start, "end", attrs'
    window = 'start BETWEEN ? AND ? AND "end" >= ?'
    bounds = [start - longest, end, start]
    marks = ",".join("?" * len(MILESTONES))
    if (
        min_duration > 0
        and end - start > wide
        and reader.has_index("events_duration")
        and reader.has_index("events_name")
    ):
        sql = (
            f'SELECT {cols} FROM events INDEXED BY events_duration WHERE "end" - start >= ? AND {window} '
            f"UNION ALL SELECT {cols} FROM events INDEXED BY events_name "
            f"WHERE name IN ({marks}) AND {window} "
            f"UNION ALL SELECT {cols} FROM events INDEXED BY events_name "
            f"WHERE name >= 'eval_' AND name < 'eval`' AND {window}"
        )
        args: list[Any] = [min_duration, *bounds, *MILESTONES, *bounds, *bounds]
    else:
        sql = f"SELECT {cols} FROM events WHERE {window}"
        args = list(bounds)
        if min_duration > 0:
            sql += f" AND (\"end\" - start >= ? OR name IN ({marks}) OR substr(name, 1, 5) = 'eval_')"
            args += [min_duration, *MILESTONES]
    if reader.has_table("rollout_spans") and min_duration <= longest:  # else none is long enough
        spans = f'{window} AND "end" - start >= ?'
        if min_duration >= rollout_spans.LONG_SECONDS and reader.has_index("rollout_spans_long"):
            sql += " UNION ALL " + rollout_spans.events_select(
                f"{rollout_spans.LONG} AND {spans}", "rollout_spans_long"
            )
        else:
            sql += " UNION ALL " + rollout_spans.events_select(spans)
        args += [*bounds, min_duration]
    events = reader.columns(sql + " ORDER BY start, id LIMIT ?", [*args, limit + 1])
    truncated = len(events["id"]) > limit
    return {"events": {k: v[:limit] for k, v in events.items()}, "truncated": truncated}


def lanes_window(
    reader: RunReader, start: float, end: float, longest: float, limit: int = 2_500, min_duration: float = 0.0
) -> dict[str, Any]:
    """Rollouts on the inference lanes during [start, end] (``longest``: the longest rollout's
    dispatch-to-finish seconds; those shorter than ``min_duration`` left out) and their turns'
    generation and environment spans, for a Gantt row per (server, lane). Both as columns
    ({name: [values]})."""
    rollouts = reader.columns(
        "SELECT rollout_id, group_id, sample_idx, env, status, reason, step, server, lane, reward, "
        "dispatch_time, generation_end_time, finish_time FROM rollouts "
        "WHERE dispatch_time BETWEEN ? AND ? AND finish_time >= ? AND finish_time - dispatch_time >= ? "
        "ORDER BY dispatch_time LIMIT ?",
        (start - longest, end, start, min_duration, limit + 1),
    )
    truncated = len(rollouts["rollout_id"]) > limit
    rollouts = {k: v[:limit] for k, v in rollouts.items()}
    ids = rollouts["rollout_id"]
    turns: dict[str, list[Any]] = {
        "rollout_id": [],
        "turn_idx": [],
        "start_time": [],
        "end_time": [],
        "env_time": [],
    }
    for chunk in range(0, len(ids), 900):
        part = ids[chunk : chunk + 900]
        got = reader.columns(
            "SELECT rollout_id, turn_idx, start_time, end_time, env_time FROM turns "
            f"WHERE rollout_id IN ({','.join('?' * len(part))}) ORDER BY rollout_id, turn_idx",
            part,
        )
        for k in turns:
            turns[k] += got[k]
    return {"rollouts": rollouts, "turns": turns, "truncated": truncated}


def system_metric_names(reader: RunReader, edge_seconds: float = 300.0) -> list[dict[str, str]]:
    """Each (source, name, node) with rows in the first or last ``edge_seconds`` of the metrics
    (two short index ranges instead of every row: a series that only existed mid-run is missed)."""
    if not reader.has_table("system_metrics"):
        return []
    node = "node" if "node" in {c["name"] for c in reader.rows("PRAGMA table_info(system_metrics)")} else "''"
    edges = reader.rows(SYSTEM_TIME_EDGES)[0]
    if edges["lo"] is None:
        return []
    return reader.rows(
        f"SELECT DISTINCT source, name, {node} AS node FROM system_metrics "
        "WHERE time BETWEEN ? AND ? OR time BETWEEN ? AND ? ORDER BY source, name, node",
        (edges["lo"], edges["lo"] + edge_seconds, edges["hi"] - edge_seconds, edges["hi"]),
    )


def system_series(
    reader: RunReader, name: str, start: float, end: float, points: int = 600
) -> dict[str, dict[str, list[float]]]:
    """{"<source>@<node>": {"time": [...], "value": [...]}} for one metric name in [start, end].

    A window of more than ``points`` seconds is sampled (:meth:`RunReader.system_metrics` with
    ``points``: the first sample of each series in each of ``points`` equal slices, a few index rows
    a slice); a shorter window reads every row."""
    sampled = points if end - start > points else None
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"time": [], "value": []})
    for r in reader.system_metrics(start, end, name=name, points=sampled):
        key = f"{r['source']}@{r['node']}" if r["node"] else r["source"]
        out[key]["time"].append(r["time"])
        out[key]["value"].append(r["value"])
    return dict(out)
