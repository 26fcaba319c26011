"""System metrics sampled to a number of points per series, for a window of any width: each of
``points`` equal slices of the window keeps the first sample of every (source, name, node) series in
it. A slice is read as a short range of the ``system_metrics_time`` index, stopped as soon as every
series known so far has its sample there, so a day of 1 s metrics of many GPUs reads a few rows a
slice instead of every row; a series met in a slice is then looked up alone in the slices before it,
where the read may have stopped before its sample.

A series' sample of a slice can be missing only where that slice's read stopped before it and,
between that slice and the next one whose read meets the series, some slice holds none of it."""

from __future__ import annotations

import sqlite3
from typing import Any

# the most rows read in one slice, per known series: the stop when a series is missing from a slice
# (it ended, or starts later in it), so that costs a bounded read instead of the whole slice
ROWS_PER_SERIES = 8
MIN_ROWS_PER_SLICE = 64
# the window's first rows, read for the series to wait for from the first slice on
PROBE_ROWS = 4096
COLUMNS = ("time", "source", "name", "value", "node")


def sampled_system_metrics(
    conn: sqlite3.Connection,
    filters: list[str],
    args: list[Any],
    node_column: str,
    start: float | None,
    end: float | None,
    points: int,
) -> list[dict[str, Any]]:
    """Rows (``time, source, name, value, node``) by time: per series, the first sample of each of
    ``points`` equal slices of [start, end] (a missing bound: the first or last sample's time), the
    last slice closed at ``end``. ``filters``: SQL conditions on the rows, ``args`` their values."""
    if points < 1:
        raise ValueError(f"points must be at least 1, got {points}")
    if start is None:
        start = conn.execute("SELECT MIN(time) FROM system_metrics").fetchone()[0]
    if end is None:
        end = conn.execute("SELECT MAX(time) FROM system_metrics").fetchone()[0]
    if start is None or end is None or end < start:
        return []
    width = (end - start) / points
    has_node = node_column == "node"
    node_test = "node = ?" if has_node else "1"
    where = " AND ".join(["time >= ?", "time {} ?", *filters])
    sql = f"SELECT time, source, name, value, {node_column} FROM system_metrics WHERE {where} ORDER BY time"
    # the series to wait for in each slice, first those among the window's first rows
    probe = conn.execute(
        f"SELECT DISTINCT source, name, node FROM (SELECT source, name, {node_column} FROM system_metrics "
        f"WHERE {where.format('<=')} ORDER BY time LIMIT ?)",
        (start, end, *args, PROBE_ROWS),
    )
    known: set[tuple[str, str, str]] = {tuple(r) for r in probe.fetchall()}
    series_where = " AND ".join(["time >= ?", "time <= ?", *filters, "source = ? AND name = ?", node_test])
    one_series = (
        f"SELECT time, source, name, value, {node_column} FROM system_metrics WHERE {series_where} "
        "ORDER BY time LIMIT 1"
    )
    edges = [start + i * width for i in range(points)] + [end]
    slices: list[dict[tuple[str, str, str], dict[str, Any]]] = []

    def look_back(key: tuple[str, str, str], back: int) -> None:
        """A slice's read stops early (every known series seen, or its row budget spent), so a series
        first met in slice ``back + 1`` may have had an unread sample in the slices before it: read
        them for that series alone, back to one without a sample of it."""
        while back >= 0 and key not in slices[back]:
            lo, hi = edges[back], edges[back + 1]
            row = conn.execute(one_series, (lo, hi, *args, *key[:2], *key[2:] * has_node)).fetchone()
            if row is None or (row[0] == hi and back + 1 < len(slices)):
                return  # none, or the next slice's
            slices[back][key] = dict(zip(COLUMNS, row, strict=True))
            back -= 1

    for i in range(points):
        last = i == points - 1 or width == 0
        budget = max(MIN_ROWS_PER_SLICE, ROWS_PER_SERIES * len(known))
        firsts: dict[tuple[str, str, str], dict[str, Any]] = {}
        cursor = conn.execute(
            sql.format("<=" if last else "<"), (edges[i], end if last else edges[i + 1], *args)
        )
        for read, row in enumerate(cursor, start=1):
            key = (row[1], row[2], row[4])
            if key not in firsts:
                firsts[key] = dict(zip(COLUMNS, row, strict=True))
            if read >= budget or firsts.keys() >= known:
                break
        cursor.close()
        known |= firsts.keys()
        slices.append(firsts)
        for key in firsts:
            look_back(key, i - 1)
        if last:
            break
    for key in known:  # the last slice has no later one to look back from
        look_back(key, len(slices) - 1)
    return [row for firsts in slices for row in sorted(firsts.values(), key=lambda r: r["time"])]
