"""Read-only access to run stores (what the dashboard and tests use).

Readers open ``run.db`` read-only; in WAL mode each query sees a consistent snapshot and never
waits for the writer.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sqlite3
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refractor.telemetry import rollout_spans
from refractor.telemetry.code_snapshot import CodeFile, CodeInfo, CodeRoot, GitState
from refractor.telemetry.log_capture import LEVELS
from refractor.telemetry.metrics import RolloutSummary
from refractor.telemetry.sampling import sampled_system_metrics
from refractor.telemetry.store import table_columns, tokens_from_blob


@dataclass(frozen=True)
class RunInfo:
    name: str
    path: Path
    status: str  # as stored; a `running` run nobody holds the lock of is shown as `crashed`
    created_at: float
    last_step: int | None
    last_reward: float | None = None  # reward_sum_mean of the last step


def list_runs(runs_dir: str | Path) -> list[RunInfo]:
    """Every run under ``runs_dir`` that has a run.db, newest first."""
    from refractor.runtime.run_lock import is_held

    out = []
    for db in sorted(Path(runs_dir).glob("*/run.db")):
        with RunReader(db.parent) as r:
            meta = r.meta()
            status = str(meta.get("status", "unknown"))
            if status == "running" and not is_held(db.parent):
                status = "crashed"  # its driver died; the next start records it so
            last_step = r.last_step()
            reward = None if last_step is None else r.step_metric(last_step, "reward_sum_mean")
            out.append(
                RunInfo(
                    str(meta.get("run_name", db.parent.name)),
                    db.parent,
                    status,
                    float(meta.get("created_at", 0.0)),
                    last_step,
                    reward,
                )
            )
    return sorted(out, key=lambda i: i.created_at, reverse=True)


class RunReader:
    def __init__(self, run_dir: str | Path) -> None:
        path = Path(run_dir) / "run.db"
        if not path.is_file():
            raise FileNotFoundError(f"no run store at {path}")
        self.path = path
        self._conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA busy_timeout=5000")

    def __enter__(self) -> RunReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._conn.close()

    def _rows(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        return [dict(r) for r in self._conn.execute(sql, args).fetchall()]

    def rows(self, sql: str, args: tuple | list = ()) -> list[dict[str, Any]]:
        """Rows of one read-only SQL query, as dicts (for the query modules built on this reader;
        the connection is read-only, so nothing a caller passes can change the store)."""
        return self._rows(sql, tuple(args))

    def columns(self, sql: str, args: tuple | list = ()) -> dict[str, list[Any]]:
        """One read-only SQL query's result as {column: [values]} (compact for large answers)."""
        cur = self._conn.execute(sql, tuple(args))
        names = [d[0] for d in cur.description]
        rows = cur.fetchall()
        return {n: [r[i] for r in rows] for i, n in enumerate(names)}

    def has_table(self, table: str) -> bool:
        return bool(table_columns(self._conn, table))

    def has_index(self, index: str) -> bool:
        row = self._conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = ?", (index,))
        return row.fetchone() is not None

    def meta(self) -> dict[str, Any]:
        return {r["key"]: json.loads(r["value"]) for r in self._rows("SELECT key, value FROM meta")}

    def step_metric(self, step: int, name: str) -> float | None:
        rows = self._rows("SELECT value FROM step_metrics WHERE step = ? AND name = ?", (step, name))
        return rows[0]["value"] if rows else None

    def topology(self) -> dict[str, Any] | None:
        """What ran where (docs/run-store.md#topology); None for a run that recorded none."""
        return self.meta().get("topology")

    def config(self) -> dict[str, Any]:
        return self.meta().get("config", {})

    def last_step(self) -> int | None:
        # training steps only: eval metrics sit at 1-indexed steps (after N steps), see evals
        row = self._conn.execute("SELECT MAX(step) FROM step_metrics WHERE name NOT LIKE 'eval/%'").fetchone()
        return None if row[0] is None else int(row[0])

    def step_metrics(self, names: list[str] | None = None) -> list[dict[str, Any]]:
        """One dict per step: {"step": s, "<metric>": value, ...} (optionally only ``names``)."""
        sql = "SELECT step, name, value FROM step_metrics"
        args = ()
        if names:
            sql += f" WHERE name IN ({','.join('?' * len(names))})"
            args = tuple(names)
        by_step: dict[int, dict[str, Any]] = defaultdict(dict)
        for r in self._rows(sql + " ORDER BY step", args):
            by_step[r["step"]]["step"] = r["step"]
            by_step[r["step"]][r["name"]] = r["value"]
        return [by_step[s] for s in sorted(by_step)]

    def step_times(self) -> dict[int, float]:
        """When each step's metrics were logged (the end of its weight update), by step."""
        return {
            r["step"]: r["t"]
            for r in self._rows(
                "SELECT step, MAX(time) AS t FROM step_metrics WHERE name NOT LIKE 'eval/%' GROUP BY step"
            )
        }

    def rollouts(
        self, step: int | None = None, status: str | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        clauses = []
        args = []
        if step is not None:
            clauses.append("step = ?")
            args.append(step)
        if status is not None:
            clauses.append("status = ?")
            args.append(status)
        sql = (
            "SELECT * FROM rollouts"
            + (f" WHERE {' AND '.join(clauses)}" if clauses else "")
            + " ORDER BY rollout_id"
        )
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        rows = self._rows(sql, tuple(args))
        for r in rows:
            r["sample_metrics"] = json.loads(r["sample_metrics"])
            r["golden_answers"] = json.loads(r["golden_answers"])
            r["completion_ids"] = tokens_from_blob(r["completion_ids"])
        return rows

    def rollout_summaries(self, step: int) -> list[RolloutSummary]:
        """Rows of one step in the shape :func:`refractor.telemetry.metrics.rollout_step_metrics` takes."""
        return [
            RolloutSummary(
                r["group_id"],
                r["status"],
                r["reason"],
                r["reward"],
                r["advantage"],
                r["prompt_tokens"],
                r["completion_tokens"],
                r["stop_reason"],
                r["off_policy_steps"],
                r["sample_metrics"],
            )
            for r in self.rollouts(step=step)
        ]

    def turns(self, rollout_id: int) -> list[dict[str, Any]]:
        rows = self._rows("SELECT * FROM turns WHERE rollout_id = ? ORDER BY turn_idx", (rollout_id,))
        calls = self._rows(
            "SELECT * FROM tool_calls WHERE rollout_id = ? ORDER BY turn_idx, call_idx", (rollout_id,)
        )
        for r in rows:
            r["env_messages"] = json.loads(r["env_messages"])
            r["tool_calls"] = [c for c in calls if c["turn_idx"] == r["turn_idx"]]
        return rows

    def timeline(
        self,
        start: float | None = None,
        end: float | None = None,
        component: str | None = None,
        *,
        after: tuple[float, int] | None = None,
        limit: int | None = None,
        longest: float | None = None,
    ) -> list[dict[str, Any]]:
        """Events overlapping [start, end] (either bound optional), ordered by ``(start, id)``, the
        rollouts' lifecycle spans (stored apart since schema 6, negative ids) among them.

        Paged: ``limit`` caps the answer; ``after`` is the ``(start, id)`` of the last event of the
        previous page, and the next page is the events past it in that order (a page shorter than
        ``limit`` is the last). Pages are index ranges on ``events_start`` and ``rollout_spans_start``
        from the cursor on; an event overlapping the window's left edge may have started any time
        before it, so the first pages read from the first event unless ``longest`` (the longest
        event's or span's duration, which the dashboard keeps as a running maximum) bounds them."""
        clauses = ["1"]
        bounds: list[Any] = []
        if start is not None:
            clauses.append('"end" >= ?')
            bounds.append(start)
            if longest is not None:
                clauses.append("start >= ?")
                bounds.append(start - longest)
        if end is not None:
            clauses.append("start <= ?")
            bounds.append(end)
        where = " AND ".join(clauses)
        # past the cursor: a later start, or the same start and a larger id; `start >= ?` is the
        # index range, the rest drops the ties already read. A span's id is minus its row id.
        events_where = spans_where = where
        events_args = list(bounds)
        spans_args = list(bounds)
        if after is not None:
            after_start, after_id = after
            events_where += " AND start >= ? AND (start > ? OR id > ?)"
            events_args += [after_start, after_start, after_id]
            spans_where += " AND start >= ? AND (start > ? OR id < ?)"
            spans_args += [after_start, after_start, -after_id]
        sql = f'SELECT id, name, component, step, start, "end", attrs FROM events WHERE {events_where}'
        args = events_args
        if component is not None:
            sql += " AND component = ?"
            args.append(component)
        if self.has_table("rollout_spans") and component in (None, rollout_spans.COMPONENT):
            sql += " UNION ALL " + rollout_spans.events_select(spans_where)
            args += spans_args
        sql += " ORDER BY start, id"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(int(limit))
        rows = self._rows(sql, tuple(args))
        for r in rows:
            r["attrs"] = json.loads(r["attrs"])
        return rows

    def system_metrics(
        self,
        start: float | None = None,
        end: float | None = None,
        *,
        name: str | None = None,
        source: str | None = None,
        node: str | None = None,
        points: int | None = None,
    ) -> list[dict[str, Any]]:
        """Rows (``time, source, name, value, node``) in [start, end], by time; each filter optional.
        A run store written before nodes were recorded gives ``node`` ''. With ``points``, at most
        that many rows per (source, name, node) series: the first of each of ``points`` equal slices
        of the window (:mod:`.sampling`)."""
        clauses = ["time BETWEEN ? AND ?"]
        args: list[Any] = [float("-inf") if start is None else start, float("inf") if end is None else end]
        for column, value in (("name", name), ("source", source), ("node", node)):
            if value is not None:
                clauses.append(f"{column} = ?")
                args.append(value)
        if "node" in table_columns(self._conn, "system_metrics"):
            node_column = "node"
        elif node is None:
            node_column = "'' AS node"
        else:
            return []
        if points is not None:
            filters = clauses[1:]
            return sampled_system_metrics(self._conn, filters, args[2:], node_column, start, end, points)
        sql = (
            f"SELECT time, source, name, value, {node_column} FROM system_metrics "
            f"WHERE {' AND '.join(clauses)} ORDER BY time"
        )
        return self._rows(sql, tuple(args))

    def logs(
        self,
        component: str | None = None,
        level: str | None = None,
        text: str | None = None,
        rank: int | None = None,
        *,
        after_id: int | None = None,
        before_id: int | None = None,
        limit: int = 500,
    ) -> list[dict[str, Any]]:
        """A page of log lines (``id, time, level, component, rank, node, source, message``), oldest
        first: the newest ``limit`` lines that match, or with ``after_id`` the first ``limit`` lines
        after that id (follow a live log by passing the last id seen), or with ``before_id`` the
        newest ``limit`` lines before it (scroll back). ``level``: that level and above; ``text``:
        lines containing it (case-insensitive for ASCII). A run store without logs reads empty."""
        if not table_columns(self._conn, "logs"):
            return []
        clauses = []
        args: list[Any] = []
        if component is not None:
            clauses.append("component = ?")
            args.append(component)
        if rank is not None:
            clauses.append("rank = ?")
            args.append(rank)
        if level is not None:
            clauses.append(f"level IN ({','.join('?' * len(levels_from(level)))})")
            args += levels_from(level)
        if text:
            clauses.append("message LIKE ? ESCAPE '\\'")
            args.append("%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%")
        if after_id is not None:
            clauses.append("id > ?")
            args.append(after_id)
        if before_id is not None:
            clauses.append("id < ?")
            args.append(before_id)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        order = "ASC" if after_id is not None else "DESC"
        rows = self._rows(f"SELECT * FROM logs{where} ORDER BY id {order} LIMIT ?", (*args, int(limit)))
        return rows if order == "ASC" else rows[::-1]

    def log_summary(self) -> list[dict[str, Any]]:
        """Per component and rank: ``lines``, ``warnings`` (WARNING and above), ``first_time``,
        ``last_time``, ``last_id``; ordered by component, then rank (what a log view offers)."""
        if not table_columns(self._conn, "logs"):
            return []
        return self._rows(
            "SELECT component, rank, COUNT(*) AS lines, "
            "SUM(level IN ('WARNING', 'ERROR', 'CRITICAL')) AS warnings, "
            "MIN(time) AS first_time, MAX(time) AS last_time, MAX(id) AS last_id "
            "FROM logs GROUP BY component, rank ORDER BY component, rank"
        )

    # --- the code snapshot (docs/run-store.md#code-snapshot); a run store without one reads empty ---
    def code_info(self) -> CodeInfo | None:
        counts = self.meta().get("code_snapshot")
        if counts is None or not table_columns(self._conn, "code_roots"):
            return None
        known = {f.name for f in dataclasses.fields(CodeInfo)} - {"roots"}
        roots = [
            CodeRoot(
                r["root"],
                r["folder"],
                None
                if r["git_commit"] is None
                else GitState(
                    r["git_commit"],
                    r["git_branch"],
                    bool(r["git_dirty"]),
                    r["git_diff"],
                    bool(r["git_diff_truncated"]),
                ),
            )
            for r in self._rows("SELECT * FROM code_roots ORDER BY rowid")
        ]
        return CodeInfo(roots=roots, **{k: v for k, v in counts.items() if k in known})

    def code_files(self) -> list[CodeFile]:
        if not table_columns(self._conn, "code_files"):
            return []
        rows = self._rows("SELECT root, path, size, sha256 FROM code_files ORDER BY root, path")
        return [CodeFile(**r) for r in rows]

    def code_file(self, root: str, path: str) -> str | None:
        """A stored file's text (undecodable bytes become U+FFFD); None when it is not stored."""
        if not table_columns(self._conn, "code_files"):
            return None
        row = self._conn.execute(
            "SELECT content FROM code_files WHERE root = ? AND path = ?", (root, path)
        ).fetchone()
        return None if row is None else zlib.decompress(row[0]).decode("utf-8", "replace")


def levels_from(level: str) -> list[str]:
    """``level`` and every level above it."""
    name = level.upper()
    if name not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; one of {', '.join(LEVELS)}")
    return list(LEVELS[LEVELS.index(name) :])


@dataclass(frozen=True)
class FileChange:
    root: str
    path: str
    diff: str  # unified diff from the first run's file to the second's (/dev/null when absent)


@dataclass(frozen=True)
class CodeDiff:
    added: list[FileChange]  # in the second run only
    removed: list[FileChange]  # in the first run only
    changed: list[FileChange]

    @property
    def same(self) -> bool:
        return not (self.added or self.removed or self.changed)


def diff_code(before: RunReader, after: RunReader, context: int = 3) -> CodeDiff:
    """How the code snapshot of ``after`` differs from that of ``before``, file by file (files are
    compared by SHA-256; only those that differ are read)."""
    old = {(f.root, f.path): f.sha256 for f in before.code_files()}
    new = {(f.root, f.path): f.sha256 for f in after.code_files()}

    def change(key: tuple[str, str]) -> FileChange:
        a = before.code_file(*key) if key in old else None
        b = after.code_file(*key) if key in new else None
        name = "/".join(key)
        lines = difflib.unified_diff(
            [] if a is None else a.splitlines(keepends=True),
            [] if b is None else b.splitlines(keepends=True),
            "/dev/null" if a is None else f"a/{name}",
            "/dev/null" if b is None else f"b/{name}",
            n=context,
        )
        return FileChange(*key, "".join(line if line.endswith("\n") else line + "\n" for line in lines))

    return CodeDiff(
        added=[change(k) for k in sorted(new.keys() - old.keys())],
        removed=[change(k) for k in sorted(old.keys() - new.keys())],
        changed=[change(k) for k in sorted(old.keys() & new.keys()) if old[k] != new[k]],
    )
