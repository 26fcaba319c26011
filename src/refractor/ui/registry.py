"""The runs the dashboard serves: every ``<runs dir>/<run>/run.db``, found again on each listing
(runs appear while the dashboard is open), each with a short id used in URLs. Summaries are cached
per run until its files change, so listing 500 runs reads only the runs that moved."""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refractor.runtime.run_lock import is_held
from refractor.telemetry.query import RunReader

# Rows of a step keep arriving after later steps have rows: a discarded rollout is stored under the
# step being filled, ahead of the steps still training when rollouts run asynchronously. So a
# cached per-step answer re-reads this many of the newest steps it has seen.
REREAD_STEPS = 16


class UnknownRunError(LookupError):
    pass


@dataclass(frozen=True)
class RunEntry:
    id: str  # the run folder's name; `name~2`, `name~3` for the same name in a later runs dir
    path: Path  # the run directory


class RunRegistry:
    def __init__(self, runs_dirs: list[Path]) -> None:
        self.runs_dirs = [Path(d) for d in runs_dirs]
        self._summaries: dict[Path, tuple[tuple, dict[str, Any]]] = {}
        self._cache: dict[tuple[Path, str], tuple[tuple, Any]] = {}
        self._maxima: dict[tuple[Path, str], tuple[float | None, int]] = {}
        self._listed: tuple[float, list[RunEntry]] | None = None

    def entries(self, fresh: bool = False) -> list[RunEntry]:
        """Every run, found again at most once a second (a page's requests share one listing), or
        now when ``fresh``."""
        now = time.monotonic()
        if fresh or self._listed is None or now - self._listed[0] > 1.0:
            self._listed = (now, self._find())
        return self._listed[1]

    def _find(self) -> list[RunEntry]:
        out = []
        seen: dict[str, int] = {}
        for runs_dir in self.runs_dirs:
            for db in sorted(runs_dir.glob("*/run.db")):
                name = db.parent.name
                seen[name] = seen.get(name, 0) + 1
                out.append(RunEntry(name if seen[name] == 1 else f"{name}~{seen[name]}", db.parent))
        return out

    def get(self, run_id: str) -> RunEntry:
        """The run of that id; an id not in the shared listing is looked up again on disk, so a run
        created less than a second ago is found too."""
        for fresh in (False, True):
            for entry in self.entries(fresh):
                if entry.id == run_id:
                    return entry
        raise UnknownRunError(f"no run {run_id!r} under {', '.join(str(d) for d in self.runs_dirs)}")

    def cached(self, entry: RunEntry, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, reused until the run's files change (for answers that read a whole run)."""
        state = _file_state(entry.path)
        hit = self._cache.get((entry.path, key))
        if hit is not None and hit[0] == state:
            return hit[1]
        if len(self._cache) > 256:
            self._cache.clear()
        value = compute()
        self._cache[(entry.path, key)] = (state, value)
        return value

    def running_max(
        self, entry: RunEntry, key: str, read: Callable[[int], tuple[float | None, int]]
    ) -> float | None:
        """A maximum over a run's append-only rows: ``read(after)`` gives the maximum over the rows
        past id ``after`` and the last id; only rows not seen before are read."""
        value, last = self._maxima.get((entry.path, key), (None, 0))
        new, last = read(last)
        if new is not None:
            value = new if value is None else max(value, new)
        self._maxima[(entry.path, key)] = (value, last)
        return value

    def cached_steps(
        self, entry: RunEntry, key: str, compute: Callable[[int | None], dict[int, Any]]
    ) -> dict[int, Any]:
        """A per-step answer kept across changes of a live run: only the newest ``REREAD_STEPS``
        steps seen and later ones are read again (``compute(since)`` gives the steps after
        ``since``); when those are gone (a resume redoes them) everything is read."""
        state = _file_state(entry.path)
        hit = self._cache.get((entry.path, key))
        if hit is not None and hit[0] == state:
            return hit[1]
        old: dict[int, Any] = hit[1] if hit is not None else {}
        merged = None
        if len(old) > REREAD_STEPS:
            since = sorted(old)[-REREAD_STEPS - 1]
            fresh = compute(since)
            if fresh:  # none at all: the newest steps went away (a resume), so read everything
                merged = {s: v for s, v in old.items() if s <= since} | fresh
        if merged is None:
            merged = compute(None)
        self._cache[(entry.path, key)] = (state, merged)
        return merged

    def summary(self, entry: RunEntry) -> dict[str, Any]:
        """Status, progress and the config's headline keys; an unreadable store gives its error."""
        key = _file_state(entry.path)
        cached = self._summaries.get(entry.path)
        if cached is not None and cached[0] == key:
            summary = dict(cached[1])
        else:
            summary = _read_summary(entry)
            self._summaries[entry.path] = (key, summary)
            summary = dict(summary)
        summary["id"] = entry.id
        if summary["status"] == "running" and not is_held(entry.path):
            summary["status"] = "crashed"  # its writer died; the next start records it so
        return summary


def _file_state(run_dir: Path) -> tuple:
    out = []
    for name in ("run.db", "run.db-wal"):
        try:
            st = os.stat(run_dir / name)
        except OSError:
            out.append(None)
            continue
        # an empty WAL is no change: a reader's first open of a closed store creates one
        out.append((st.st_mtime_ns, st.st_size) if st.st_size else None)
    return tuple(out)


def _read_summary(entry: RunEntry) -> dict[str, Any]:
    base: dict[str, Any] = {"name": entry.path.name, "path": str(entry.path), "error": ""}
    try:
        with RunReader(entry.path) as reader:
            meta = reader.meta()
            config = meta.get("config") or {}
            last = reader.rows("SELECT MAX(step) AS s FROM step_metrics WHERE name = 'reward_sum_mean'")[0][
                "s"
            ]
            reward = None if last is None else reader.step_metric(last, "reward_sum_mean")
            steps = reader.last_step()
    except sqlite3.OperationalError as err:
        if "no such" not in str(err):
            raise
        message = f"the run store is incomplete ({err}): an older or unfinished run"
        return base | {"status": "incomplete", "error": message, "created_at": 0}
    except (sqlite3.DatabaseError, ValueError) as err:
        return base | {
            "status": "unreadable",
            "error": f"the run store cannot be read: {err}",
            "created_at": 0,
        }
    return base | {
        "name": str(meta.get("run_name", entry.path.name)),
        "status": str(meta.get("status", "unknown")),
        "created_at": float(meta.get("created_at", 0.0)),
        "finished_at": meta.get("finished_at"),
        "steps": 0 if steps is None else steps + 1,
        "last_reward": reward,
        "model": config.get("model", ""),
        "algorithm": config.get("algorithm", config.get("loss_type", "")),
        "engine": meta.get("engine", config.get("inference_engine", "")),
        "schema_version": meta.get("schema_version"),
    }
