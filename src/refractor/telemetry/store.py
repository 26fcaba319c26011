"""The run store: ``runs/<run_name>/run.db``, SQLite in WAL mode, one writer (the orchestrator).

Writes never block the caller: every ``log_*`` call turns its arguments into plain rows at once
(so later mutation of a record cannot change what is stored) and hands them to a writer thread,
which commits them in batched transactions. WAL lets readers (the dashboard, :mod:`.query`) read a
consistent snapshot at any time without blocking the writer or being blocked by it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import sqlite3
import sys
import threading
import time
import zlib
from array import array
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refractor.errors import RefractorUserError
from refractor.records import EvalRollout, Rollout, RolloutStatus, TimelineEvent
from refractor.telemetry import rollout_spans

if TYPE_CHECKING:
    from refractor.telemetry.code_snapshot import CodeSnapshot
    from refractor.telemetry.log_capture import LogLine

# 2: system_metrics.node (the address of the machine a row comes from); 3: code_roots, code_files;
# 4: logs
# 5: indexes for the dashboard's reads (step metrics by name; rollouts by dispatch time, and the
# rollout columns per-step statistics read, so they never read the rollouts' texts; events by
# duration and by name, for a zoomed-out timeline)
# 6: rollout_spans (the rollouts' lifecycle spans, no longer in events); step_metrics, sample_metrics
# and turns stored by their primary key (WITHOUT ROWID: no second copy of the key in an index)
SCHEMA_VERSION = 6

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS step_metrics (
    step INTEGER NOT NULL, name TEXT NOT NULL, value REAL, time REAL NOT NULL,
    PRIMARY KEY (step, name)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS step_metrics_by_name ON step_metrics (name, step, value);
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id INTEGER PRIMARY KEY, group_id INTEGER NOT NULL, sample_idx INTEGER NOT NULL,
    env TEXT NOT NULL, status TEXT NOT NULL, reason TEXT NOT NULL, error TEXT NOT NULL,
    step INTEGER NOT NULL, trainer_step INTEGER NOT NULL, inference_step INTEGER NOT NULL,
    prompt_text TEXT NOT NULL, system_prompt TEXT NOT NULL, completion_text TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, total_tokens INTEGER NOT NULL,
    num_turns INTEGER NOT NULL, stop_reason TEXT NOT NULL, reward REAL, advantage REAL,
    sample_metrics TEXT NOT NULL, golden_answers TEXT NOT NULL,
    start_version INTEGER, end_version INTEGER, off_policy_steps INTEGER NOT NULL,
    lane INTEGER NOT NULL, server TEXT NOT NULL, retokenized INTEGER NOT NULL,
    dispatch_time REAL, generation_end_time REAL, finish_time REAL, reward_time REAL,
    prompt_index INTEGER NOT NULL, prompt_ordinal INTEGER NOT NULL, completion_ids BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS rollouts_step_status ON rollouts (step, status);
CREATE INDEX IF NOT EXISTS rollouts_dispatch ON rollouts (dispatch_time);
CREATE INDEX IF NOT EXISTS rollouts_step_stats ON rollouts (status, step, env, group_id, reward, advantage,
    prompt_tokens, completion_tokens, stop_reason, off_policy_steps, reason);
CREATE TABLE IF NOT EXISTS sample_metrics (
    rollout_id INTEGER NOT NULL, step INTEGER NOT NULL, status TEXT NOT NULL, name TEXT NOT NULL, value REAL,
    PRIMARY KEY (rollout_id, name)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS turns (
    rollout_id INTEGER NOT NULL, turn_idx INTEGER NOT NULL, content TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, finish_reason TEXT NOT NULL,
    max_tokens INTEGER NOT NULL, start_version INTEGER NOT NULL, end_version INTEGER NOT NULL,
    start_time REAL, end_time REAL, env_messages TEXT NOT NULL, env_time REAL,
    PRIMARY KEY (rollout_id, turn_idx)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tool_calls (
    rollout_id INTEGER NOT NULL, turn_idx INTEGER NOT NULL, call_idx INTEGER NOT NULL,
    tool_name TEXT NOT NULL, arguments TEXT NOT NULL, result TEXT NOT NULL, success INTEGER NOT NULL,
    error TEXT NOT NULL, extra TEXT NOT NULL, PRIMARY KEY (rollout_id, turn_idx, call_idx));
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, component TEXT NOT NULL,
    step INTEGER, start REAL NOT NULL, "end" REAL NOT NULL, attrs TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_start ON events (start);
CREATE INDEX IF NOT EXISTS events_duration ON events (("end" - start));
CREATE INDEX IF NOT EXISTS events_name ON events (name, start);
CREATE TABLE IF NOT EXISTS rollout_spans (
    id INTEGER PRIMARY KEY, kind INTEGER NOT NULL, step INTEGER, start REAL NOT NULL, "end" REAL NOT NULL,
    rollout_id, group_id, sample, turn, server, lane, finish_reason, completion_tokens,
    queue_time, ttft, prefill_time, decode_time, e2e_latency, ok, outcome, extra TEXT);
CREATE INDEX IF NOT EXISTS rollout_spans_start ON rollout_spans (start);
CREATE INDEX IF NOT EXISTS rollout_spans_long ON rollout_spans (start) WHERE "end" - start >= 1.0;
CREATE TABLE IF NOT EXISTS system_metrics (
    time REAL NOT NULL, source TEXT NOT NULL, name TEXT NOT NULL, value REAL,
    node TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS system_metrics_time ON system_metrics (time);
CREATE TABLE IF NOT EXISTS code_roots (
    root TEXT PRIMARY KEY, folder TEXT NOT NULL, git_commit TEXT, git_branch TEXT, git_dirty INTEGER,
    git_diff TEXT, git_diff_truncated INTEGER);
CREATE TABLE IF NOT EXISTS code_files (
    root TEXT NOT NULL, path TEXT NOT NULL, size INTEGER NOT NULL, sha256 TEXT NOT NULL,
    content BLOB NOT NULL, PRIMARY KEY (root, path));
CREATE TABLE IF NOT EXISTS logs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, level TEXT NOT NULL, component TEXT NOT NULL,
    rank INTEGER, node TEXT NOT NULL, source TEXT NOT NULL, message TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS logs_component ON logs (component, id);
"""

# Columns added after version 1, added to an older run.db when a run writes to it again (a resume):
# (table, column, definition). Tables added later are created by SCHEMA itself.
MIGRATIONS = [("system_metrics", "node", "TEXT NOT NULL DEFAULT ''")]


def connect_writer(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable at checkpoints, fast commits
    conn.execute("PRAGMA busy_timeout=5000")
    conn.executescript(SCHEMA)
    for table, column, definition in MIGRATIONS:
        if column not in table_columns(conn, table):
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
    conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (_json(SCHEMA_VERSION),))
    return conn


def table_columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


def mark_crashed(path: Path) -> bool:
    """A run store still marked ``running`` whose writer is gone (the caller holds the run lock):
    mark it ``crashed``. Returns whether it was."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA busy_timeout=5000")
        cur = conn.execute(
            "UPDATE meta SET value = ? WHERE key = 'status' AND value = ?",
            (_json("crashed"), _json("running")),
        )
        return cur.rowcount > 0
    finally:
        conn.close()


def _json(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)


def _compact_json(value: Any) -> str:
    """JSON without the spaces after separators (for the rows written by the thousand)."""
    return json.dumps(value, default=str, ensure_ascii=False, separators=(",", ":"))


def rollout_rows(
    rollouts: Iterable[Rollout], trainer_step: int, inference_step: int
) -> list[tuple[str, list[tuple]]]:
    """(sql, rows) pairs that store each rollout with its turns, tool calls and sample metrics."""
    ro = []
    tu = []
    tc = []
    sm = []
    for r in rollouts:
        status = str(r.status)
        step = stored_step(r, inference_step)
        ro.append(
            (
                r.rollout_id,
                r.group_id,
                r.sample_idx,
                r.env_name,
                status,
                r.reason,
                r.error,
                step,
                trainer_step,
                inference_step,
                r.prompt_text,
                r.system_prompt,
                r.completion_text,
                len(r.prompt_ids),
                r.num_completion_tokens,
                len(r.prompt_ids) + len(r.completion_ids),
                r.num_turns,
                r.stop_reason,
                r.reward,
                r.advantage,
                _json(r.sample_metrics),
                _json(r.golden_answers),
                r.start_version,
                r.end_version,
                r.off_policy_steps,
                r.lane,
                r.server,
                int(r.retokenized),
                r.dispatch_time,
                r.generation_end_time,
                r.finish_time,
                r.reward_time,
                r.prompt_index,
                r.prompt_ordinal,
                token_blob(r.completion_ids),
            )
        )
        sm += [(r.rollout_id, step, status, k, float(v)) for k, v in r.sample_metrics.items()]
        for t in r.turns:
            tu.append(
                (
                    r.rollout_id,
                    t.index,
                    t.completion_text,
                    len(t.prompt_ids),
                    len(t.completion_ids),
                    t.finish_reason,
                    t.max_tokens,
                    t.start_version,
                    t.end_version,
                    t.start_time,
                    t.end_time,
                    _json(t.env_messages),
                    t.env_time,
                )
            )
            tc += [
                (
                    r.rollout_id,
                    t.index,
                    i,
                    c.tool_name,
                    c.arguments,
                    c.result,
                    int(c.success),
                    c.error,
                    _json(c.raw),
                )
                for i, c in enumerate(t.tool_calls)
            ]
    return [
        ("INSERT OR REPLACE INTO rollouts VALUES (" + ",".join("?" * 35) + ")", ro),
        ("INSERT OR REPLACE INTO turns VALUES (" + ",".join("?" * 13) + ")", tu),
        ("INSERT OR REPLACE INTO tool_calls VALUES (?,?,?,?,?,?,?,?,?)", tc),
        ("INSERT OR REPLACE INTO sample_metrics VALUES (?,?,?,?,?)", sm),
    ]


def code_snapshot_rows(snapshot: CodeSnapshot) -> list[tuple[str, list[tuple]]]:
    """(sql, rows) pairs that replace the stored code snapshot: its roots, its files (zlib
    compressed) and its counts (meta ``code_snapshot``)."""
    roots = [
        (r.label, r.folder)
        + (
            (None,) * 5
            if r.git is None
            else (r.git.commit, r.git.branch, int(r.git.dirty), r.git.diff, int(r.git.diff_truncated))
        )
        for r in snapshot.info.roots
    ]
    files = [(f.root, f.path, f.size, f.sha256, zlib.compress(content)) for f, content in snapshot.files]
    counts = {k: v for k, v in dataclasses.asdict(snapshot.info).items() if k != "roots"}
    return [
        ("DELETE FROM code_roots", [()]),
        ("DELETE FROM code_files", [()]),
        ("INSERT INTO code_roots VALUES (?,?,?,?,?,?,?)", roots),
        ("INSERT INTO code_files VALUES (?,?,?,?,?)", files),
        ("INSERT OR REPLACE INTO meta VALUES ('code_snapshot', ?)", [(_json(counts),)]),
    ]


def token_blob(ids: Iterable[int]) -> bytes:
    """Token ids as little-endian int32 bytes (4 bytes a token instead of ~7 as JSON text)."""
    out = array("i", ids)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def tokens_from_blob(blob: bytes) -> list[int]:
    out = array("i")
    out.frombytes(blob)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tolist()


def stored_step(rollout: Rollout, inference_step: int) -> int:
    """The ``step`` column: an eval row's reported eval step; a training rollout's step being filled
    (the caller passes the step that trained on a kept rollout)."""
    return rollout.step if isinstance(rollout, EvalRollout) else inference_step


class RunStoreError(RefractorUserError, RuntimeError):
    """A write to the run store failed (a full disk, most often); the run stops and can resume."""


class RunStore:
    """Single writer of one run's database. Safe to call from the event loop (never blocks on I/O)."""

    def __init__(
        self,
        run_dir: str | Path,
        config: Mapping[str, Any] | None = None,
        run_name: str | None = None,
        record_telemetry: bool = True,
    ) -> None:
        """``record_telemetry`` false: events, system metrics, log lines and code snapshots handed to
        the store are dropped (the config key of that name)."""
        self.run_dir = Path(run_dir)
        self.record_telemetry = record_telemetry
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "run.db"
        self._conn = connect_writer(self.path)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._closed = False
        self.writer_cpu_seconds = 0.0  # CPU time of the writer thread's transactions
        self.transactions = 0
        self._thread = threading.Thread(target=self._writer, name="refractor-run-store", daemon=True)
        self._thread.start()
        # first open creates the run; a resumed run keeps its creation time but is running again
        self.set_meta(
            {
                "schema_version": SCHEMA_VERSION,
                "run_name": run_name or self.run_dir.name,
                "created_at": time.time(),
            },
            replace_existing=False,
        )
        self.set_meta({"status": "running", **({"config": dict(config)} if config is not None else {})})

    # --- public API (enqueue only) ---
    def set_meta(self, items: Mapping[str, Any], replace_existing: bool = True) -> None:
        verb = "INSERT OR REPLACE" if replace_existing else "INSERT OR IGNORE"
        self._put(f"{verb} INTO meta VALUES (?, ?)", [(k, _json(v)) for k, v in items.items()])

    def log_step_metrics(
        self, step: int, metrics: Mapping[str, float], timestamp: float | None = None
    ) -> None:
        ts = time.time() if timestamp is None else timestamp
        rows = [(step, k, None if v is None else float(v), ts) for k, v in metrics.items()]
        self._put("INSERT OR REPLACE INTO step_metrics VALUES (?, ?, ?, ?)", rows)

    def log_rollouts(self, rollouts: Iterable[Rollout], trainer_step: int, inference_step: int) -> None:
        for sql, rows in rollout_rows(rollouts, trainer_step, inference_step):
            self._put(sql, rows)

    def log_event(self, event: TimelineEvent, step: int | None = None) -> None:
        self.log_events([event], step)

    def log_events(self, events: Iterable[TimelineEvent], step: int | None = None) -> None:
        """Timeline events; the rollouts' lifecycle spans go to ``rollout_spans`` (:mod:`.rollout_spans`)."""
        if not self.record_telemetry:
            return
        rows = []
        spans = []
        for e in events:
            if rollout_spans.is_rollout_span(e):
                spans.append(rollout_spans.span_row(e, step))
            else:
                rows.append(
                    (e.name, e.component, e.attrs.get("step", step), e.start, e.end, _compact_json(e.attrs))
                )
        self._put(
            'INSERT INTO events (name, component, step, start, "end", attrs) VALUES (?,?,?,?,?,?)', rows
        )
        self._put(rollout_spans.INSERT, spans)

    def log_system_metrics(
        self, source: str, metrics: Mapping[str, float], timestamp: float | None = None, node: str = ""
    ) -> None:
        """``node``: the address of the machine measured ('' for what is not one machine's)."""
        if not self.record_telemetry:
            return
        ts = time.time() if timestamp is None else timestamp
        self._put(
            "INSERT INTO system_metrics (time, source, name, value, node) VALUES (?,?,?,?,?)",
            [(ts, source, k, float(v), node) for k, v in metrics.items()],
        )

    def log_lines(self, lines: Iterable[LogLine]) -> None:
        """Log lines of any component (docs/run-store.md#logs)."""
        if not self.record_telemetry:
            return
        self._put(
            "INSERT INTO logs (time, level, component, rank, node, source, message) VALUES (?,?,?,?,?,?,?)",
            [(x.time, x.level, x.component, x.rank, x.node, x.source, x.message) for x in lines],
        )

    def log_code_snapshot(self, snapshot: CodeSnapshot) -> None:
        """Store the run's code in one transaction, replacing any earlier snapshot (a resumed run
        records the code it resumed with)."""
        if not self.record_telemetry:
            return
        self._put_all(code_snapshot_rows(snapshot))

    def abandon_unfinished(self, next_step: int, reason: str) -> None:
        """A resumed run redoes every step from ``next_step`` on: what an earlier attempt wrote for
        those steps is marked ``abandoned`` (rollouts, their sample metrics) or removed (step
        metrics), so each step's rows are exactly what it trained on. Evals reported at
        ``next_step`` ran on the checkpointed weights and stay."""
        abandoned = RolloutStatus.ABANDONED.value
        eval_status = RolloutStatus.EVAL.value
        redone = "(step >= ? AND status != ?) OR (step > ? AND status = ?)"
        args = (next_step, eval_status, next_step, eval_status)
        self._put(f"UPDATE rollouts SET status = ?, reason = ? WHERE {redone}", [(abandoned, reason, *args)])
        self._put(f"UPDATE sample_metrics SET status = ? WHERE {redone}", [(abandoned, *args)])
        self._put(
            "DELETE FROM step_metrics WHERE (step >= ? AND name NOT LIKE 'eval/%') "
            "OR (step > ? AND name LIKE 'eval/%')",
            [(next_step, next_step)],
        )

    def flush(self, timeout: float | None = 30.0) -> None:
        """Block until everything enqueued so far is committed (not for the event loop's hot path)."""
        done = threading.Event()
        self._queue.put(done)
        if not done.wait(timeout):
            raise TimeoutError(f"run store {self.path}: writer did not drain within {timeout}s")
        self._raise_if_failed()

    def close(self, status: str = "finished") -> None:
        """Write the final status, stop the writer and close the database; after a failed write
        (nothing more is written) it still stops and closes, then raises that failure."""
        if self._closed:
            return
        if self._error is None:
            self.set_meta({"status": status, "finished_at": time.time()})
        self._queue.put(None)
        self._thread.join()
        if self._error is None:  # what recording cost this process (bench/bench_run_store.py)
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('store_stats', ?)",
                    (
                        _json(
                            {"writer_cpu_seconds": self.writer_cpu_seconds, "transactions": self.transactions}
                        ),
                    ),
                )
        self._closed = True
        self._conn.close()
        self._raise_if_failed()

    # --- writer thread ---
    def _put(self, sql: str, rows: list[tuple]) -> None:
        self._put_all([(sql, rows)])

    def _put_all(self, statements: list[tuple[str, list[tuple]]]) -> None:
        """Queue statements that are committed in the same transaction."""
        self._raise_if_failed()
        if self._closed:
            raise RuntimeError(f"run store {self.path} is closed")
        statements = [(sql, rows) for sql, rows in statements if rows]
        if statements:
            self._queue.put(statements)

    def _raise_if_failed(self) -> None:
        if self._error is None:
            return
        full = getattr(self._error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
        raise RunStoreError(
            f"run store {self.path}: "
            + ("the disk is full" if full else f"a write failed ({self._error}: is the disk full?)")
            + "; nothing more is recorded. Free space, then continue from the last checkpoint "
            "with --resume_from_checkpoint true"
        ) from self._error

    def _writer(self) -> None:
        stop = False
        while not stop:
            items = [self._queue.get()]
            while True:  # drain what is there: one transaction per burst
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            events = []
            batch = []
            for item in items:
                if item is None:
                    stop = True
                elif isinstance(item, threading.Event):
                    events.append(item)
                else:
                    batch.append(item)
            if batch and self._error is None:
                cpu = time.thread_time()
                try:
                    self._conn.execute("BEGIN")
                    for statements in batch:
                        for sql, rows in statements:
                            self._conn.executemany(sql, rows)
                    self._conn.execute("COMMIT")
                except BaseException as err:  # keep the thread alive; the next caller sees the error
                    self._error = err
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")
                self.writer_cpu_seconds += time.thread_time() - cpu
                self.transactions += 1
            for ev in events:
                ev.set()
