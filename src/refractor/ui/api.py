"""The dashboard's JSON API over one or more runs dirs: ``/api/...``, GET only for run data.

Every route opens the run store read-only for the length of the request (a fresh snapshot, so a
live run's new rows show at the next poll) and answers bad input with a 4xx and a one-line
``{"error": ...}`` (see :mod:`refractor.ui.app`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, HTTPException, Query

from refractor.telemetry import derived, rollout_query, rollout_stats, series
from refractor.telemetry.log_capture import LEVELS
from refractor.telemetry.query import RunReader, diff_code
from refractor.telemetry.run_configs import ConfigQuery, config_diff
from refractor.ui.registry import RunRegistry
from refractor.ui.replies import (
    MAX_NAMES,
    as_series,
    check_field,
    check_statuses,
    check_window,
    encode,
    has_rows,
    json_reply,
    split,
)
from refractor.ui.state import UiState
from refractor.ui.tokenizers import TokenizerUnavailable, load_tokenizer


def build_router(registry: RunRegistry, state: UiState) -> APIRouter:
    api = APIRouter(prefix="/api")

    @contextmanager
    def reader(run_id: str) -> Iterator[RunReader]:
        entry = registry.get(run_id)
        with RunReader(entry.path) as r:
            yield r

    def require_table(r: RunReader, table: str, what: str) -> None:
        if not r.has_table(table):
            raise HTTPException(409, f"this run has no {what} recorded (its run store predates them)")

    # --- runs ---
    @api.get("/runs")
    @json_reply
    def runs() -> dict[str, Any]:
        notes = state.read("notes") or {}
        hidden = state.read("hidden") or {}
        out = []
        for entry in registry.entries():
            summary = registry.summary(entry)
            key = str(entry.path.resolve())
            summary["note"] = notes.get(key, "")
            summary["hidden"] = bool(hidden.get(key))
            out.append(summary)
        out.sort(key=lambda s: s["created_at"], reverse=True)
        return {"runs": out, "runs_dirs": [str(d) for d in registry.runs_dirs]}

    @api.get("/runs/{run_id}")
    @json_reply
    def run(run_id: str) -> dict[str, Any]:
        entry = registry.get(run_id)
        summary = registry.summary(entry)
        if summary["error"]:
            raise HTTPException(
                409 if summary["status"] == "incomplete" else 422, f"run {run_id!r}: {summary['error']}"
            )
        with reader(run_id) as r:
            meta = r.meta()
            has = {
                "rollouts": has_rows(r, "rollouts", "status != 'eval'"),
                "evals": has_rows(r, "rollouts", "status = 'eval'")
                or has_rows(r, "step_metrics", "name >= 'eval/' AND name < 'eval0'"),  # by index
                "events": has_rows(r, "events"),
                "system_metrics": has_rows(r, "system_metrics"),
                "code": r.code_info() is not None,
                "logs": r.has_table("logs") and has_rows(r, "logs"),
                "topology": meta.get("topology") is not None,
            }
            envs = registry.cached(
                entry,
                "envs",
                lambda: (
                    [row["env"] for row in r.rows("SELECT DISTINCT env FROM rollouts WHERE status = 'kept'")]
                    if has["rollouts"]
                    else []
                ),
            )
            return summary | {
                "config": meta.get("config", {}),
                # {env: {sample metric: {lo, hi, invert}}}: the Rollouts page's colours
                "metric_ranges": {
                    env: {name: dataclasses.asdict(x) for name, x in by_name.items()}
                    for env, by_name in rollout_stats.metric_ranges(meta).items()
                },
                "servers": meta.get("servers"),
                "has": has,
                "envs": sorted(envs),
            }

    @api.get("/runs/{run_id}/cursor")
    @json_reply
    def cursor(run_id: str) -> dict[str, Any]:
        """What a live page polls: the newest row of each kind (changes when the run writes)."""
        entry = registry.get(run_id)
        newest = {  # each one index seek; a table an older store lacks reads None
            "step": ("step_metrics", "MAX(step)"),
            "rollout": ("rollouts", "MAX(rollout_id)"),
            "event": ("events", "MAX(id)"),
            "rollout_span": ("rollout_spans", "MAX(id)"),
            "system_time": ("system_metrics", "MAX(time)"),
            "log": ("logs", "MAX(rowid)"),
        }
        with reader(run_id) as r:
            out = {
                key: r.rows(f"SELECT {expr} AS v FROM {table}")[0]["v"] if r.has_table(table) else None
                for key, (table, expr) in newest.items()
            }
        return out | {"status": registry.summary(entry)["status"]}

    @api.get("/config-diff")
    @json_reply
    def config_difference(a: str, b: str) -> dict[str, Any]:
        with reader(a) as ra, reader(b) as rb:
            return {"a": a, "b": b, "diff": config_diff(ra.config(), rb.config())}

    @api.get("/search")
    @json_reply
    def search(q: str = Query(..., max_length=2000)) -> dict[str, Any]:
        query = ConfigQuery.parse(q)
        found = []
        for entry in registry.entries():
            try:
                with RunReader(entry.path) as r:
                    if query.matches(r.config()):
                        found.append(entry.id)
            except Exception:  # an unreadable run matches nothing; the runs list shows its error
                continue
        return {"query": q, "runs": found}

    # --- step metrics ---
    @api.get("/runs/{run_id}/metric-names")
    @json_reply
    def metric_names(run_id: str) -> dict[str, Any]:
        with reader(run_id) as r:
            names = series.metric_names(r)
        return {"names": [dataclasses.asdict(series.MetricName.parse(n)) for n in names]}

    @api.get("/runs/{run_id}/metrics")
    @json_reply
    def metrics(run_id: str, names: str = Query(..., max_length=20_000), since: int | None = None):
        wanted = split(names)
        if len(wanted) > MAX_NAMES:
            raise HTTPException(400, f"at most {MAX_NAMES} metric names per request")
        with reader(run_id) as r:
            return {"series": series.metric_series(r, wanted, since)}

    @api.get("/runs/{run_id}/derived")
    @json_reply
    def derived_metrics(run_id: str, envs: str | None = None, normalise: bool = False) -> dict[str, Any]:
        """``normalise``: the sample metrics' statistics of values normalised by each environment's
        ``metrics_ranges`` (rollout_stats.MetricRange), as the Rollouts page colours them. Each
        chosen environment's partial sums per step are read once and kept (every environment's in
        one read when none is chosen), so a choice of several environments read before is a merge."""
        entry = registry.get(run_id)
        chosen = sorted(split(envs)) or None
        with reader(run_id) as r:
            ranges = rollout_stats.metric_ranges(r.meta()) if normalise else None
            parts = [
                registry.cached_steps(
                    entry,
                    f"rollout-partials:{env}:{normalise}",
                    lambda since, env=env: rollout_stats.step_partials(r, since, ranges, env and [env]),
                )
                for env in chosen or [None]
            ]

        def merged(since: int | None) -> dict[int, dict[str, float]]:
            steps: dict[int, dict[str, rollout_stats.EnvStep]] = {}
            for part in parts:
                for step, by_env in part.items():
                    if since is None or step > since:
                        steps.setdefault(step, {}).update(by_env)
            return rollout_stats.merge(dict(sorted(steps.items())), chosen)

        # the merged steps before a live run's newest ones stay as they are, like their partial sums
        by_step = registry.cached_steps(entry, f"derived:{chosen}:{normalise}", merged)
        # kept encoded: a large answer read again at every live refresh
        return registry.cached(
            entry, f"derived-series:{chosen}:{normalise}", lambda: encode({"series": as_series(by_step)})
        )

    @api.get("/runs/{run_id}/time-shares")
    @json_reply
    def time_shares(run_id: str) -> dict[str, Any]:
        with reader(run_id) as r:
            return {"series": derived.time_shares(r)}

    @api.get("/runs/{run_id}/histogram")
    @json_reply
    def histogram(run_id: str, field: str, step: int | None = None, envs: str | None = None, bins: int = 30):
        check_field(field)
        with reader(run_id) as r:
            return derived.histogram(r, field, step, min(max(bins, 1), 200), split(envs) or None)

    @api.get("/runs/{run_id}/distribution")
    @json_reply
    def distribution(run_id: str, field: str, envs: str | None = None):
        check_field(field)
        entry = registry.get(run_id)
        with reader(run_id) as r:
            return registry.cached(
                entry,
                f"distribution:{field}:{envs}",
                lambda: derived.distribution_over_steps(r, field, envs=split(envs) or None),
            )

    # --- rollouts ---
    @api.get("/runs/{run_id}/steps")
    @json_reply
    def steps(run_id: str, status: str = "kept") -> dict[str, Any]:
        check_statuses([status])
        with reader(run_id) as r:
            return {"steps": rollout_query.steps_with_rollouts(r, status)}

    @api.get("/runs/{run_id}/steps/{step}/rollouts")
    @json_reply
    def step_rollouts(
        run_id: str,
        step: int,
        status: str = "kept",
        env: str | None = None,
        stop: str | None = None,
        reward_min: float | None = None,
        reward_max: float | None = None,
        q: str = Query("", max_length=500),
        sort: str = "group",
        desc: bool = False,
        offset: int = Query(0, ge=0),
        limit: int = Query(200, ge=1, le=1000),
    ) -> dict[str, Any]:
        statuses = split(status) or ["kept"]
        check_statuses(statuses)
        if sort not in rollout_query.SORTS:
            raise HTTPException(400, f"sort must be one of {', '.join(rollout_query.SORTS)}")
        where = rollout_query.RolloutFilter(
            tuple(statuses), tuple(split(env)), tuple(split(stop)), reward_min, reward_max, q
        )
        with reader(run_id) as r:
            page = rollout_query.step_rollouts(r, step, where, sort, desc, offset, limit)
            if "discarded" in statuses:
                page["zero_advantage"] = derived.zero_advantage_breakdown(r, step)
            return page

    @api.get("/runs/{run_id}/rollouts/{rollout_id}")
    @json_reply
    def rollout(run_id: str, rollout_id: int) -> dict[str, Any]:
        with reader(run_id) as r:
            found = rollout_query.rollout_detail(r, rollout_id)
        if found is None:
            raise HTTPException(404, f"run {run_id!r} has no rollout {rollout_id}")
        return found

    @api.get("/runs/{run_id}/rollouts/{rollout_id}/tokens")
    @json_reply
    def rollout_tokens(run_id: str, rollout_id: int) -> dict[str, Any]:
        # a plain (sync) route: FastAPI runs it in its thread pool, so loading a tokenizer
        # never blocks the event loop
        with reader(run_id) as r:
            require_table(r, "rollouts", "rollouts")
            found = rollout_query.rollout_token_segments(r, rollout_id)
            model = r.config().get("model")
        if found is None:
            raise HTTPException(404, f"run {run_id!r} has no rollout {rollout_id}")
        path = str(model or "")
        try:
            tok = load_tokenizer(path)
        except TokenizerUnavailable:
            raise HTTPException(
                404,
                f"the run's tokenizer at {path or '(no model in the run config)'} "
                "is not available on this machine",
            ) from None

        def text(ids: list[int] | None) -> str | None:
            return None if ids is None else tok.decode(ids, skip_special_tokens=False)

        for seg in found["turns"]:
            seg["input_text"] = text(seg["input_ids"])
            seg["completion_text"] = text(seg["completion_ids"])
        found["tokenizer"] = path
        return found

    @api.get("/runs/{run_id}/evals")
    @json_reply
    def evals(run_id: str) -> dict[str, Any]:
        with reader(run_id) as r:
            names = [n for n in series.metric_names(r) if n.startswith("eval/")]
            return {"evals": rollout_query.eval_names(r), "metrics": names}

    # --- wall time: timeline, infra ---
    @api.get("/runs/{run_id}/time-bounds")
    @json_reply
    def time_bounds(run_id: str) -> dict[str, Any]:
        entry = registry.get(run_id)
        with reader(run_id) as r:
            ends = [
                registry.running_max(
                    entry,
                    f"{table}_end",
                    lambda after, table=table: series.max_after(r, table, '"end"', "id", after),
                )
                for table in ("events", "rollout_spans")
                if r.has_table(table)
            ]
            if r.has_table("rollouts"):
                ends.append(
                    registry.running_max(
                        entry,
                        "rollouts_end",
                        lambda after: series.max_after(r, "rollouts", "finish_time", "rollout_id", after),
                    )
                )
            ends = [e for e in ends if e is not None]
            bounds = series.time_bounds(r, max(ends) if ends else None)
            return bounds | {"step_times": registry.cached(entry, "step_times", lambda: series.step_times(r))}

    @api.get("/runs/{run_id}/timeline")
    @json_reply
    def timeline(
        run_id: str,
        start: float,
        end: float,
        limit: int = Query(20_000, ge=1, le=100_000),
        min_duration: float = Query(0.0, ge=0.0),
    ):
        check_window(start, end)
        entry = registry.get(run_id)
        with reader(run_id) as r:
            # running maxima: a live run's new rows are read, not every row at every refresh
            longest_event = longest_rollout = 0.0
            for table in ("events", "rollout_spans"):
                if r.has_table(table):
                    longest = registry.running_max(
                        entry,
                        f"longest_{table}",
                        lambda after, table=table: series.max_after(r, table, '"end" - start', "id", after),
                    )
                    longest_event = max(longest_event, longest or 0.0)
            if r.has_table("rollouts"):
                duration = "CASE WHEN dispatch_time > 0 THEN finish_time - dispatch_time END"
                longest_rollout = registry.running_max(
                    entry,
                    "longest_rollout",
                    lambda after: series.max_after(r, "rollouts", duration, "rollout_id", after),
                )
            longest_event = longest_event or 0.0
            longest_rollout = longest_rollout or 0.0
            out = {
                "events": {"id": []},
                "truncated": False,
                "lanes": {"rollouts": {"rollout_id": []}, "turns": {"rollout_id": []}, "truncated": False},
            }
            if r.has_table("events"):  # columns: {"id": [...], "name": [...], ..., "attrs": [JSON text]}
                out |= series.events_window(r, start, end, longest_event, limit, min_duration)
            if r.has_table("rollouts") and longest_rollout >= min_duration:  # else none is wide enough
                out["lanes"] = series.lanes_window(r, start, end, longest_rollout, min_duration=min_duration)
            return out

    @api.get("/runs/{run_id}/system-names")
    @json_reply
    def system_names(run_id: str) -> dict[str, Any]:
        entry = registry.get(run_id)
        with reader(run_id) as r:
            return {"metrics": registry.cached(entry, "system_names", lambda: series.system_metric_names(r))}

    @api.get("/runs/{run_id}/system")
    @json_reply
    def system(run_id: str, name: str, start: float, end: float, points: int = Query(600, ge=10, le=5000)):
        check_window(start, end)
        with reader(run_id) as r:
            return {"name": name, "series": series.system_series(r, name, start, end, points)}

    # --- topology, code, logs ---
    @api.get("/runs/{run_id}/topology")
    @json_reply
    def topology(run_id: str) -> dict[str, Any]:
        with reader(run_id) as r:
            return {"topology": r.topology()}

    @api.get("/runs/{run_id}/code")
    @json_reply
    def code(run_id: str) -> dict[str, Any]:
        with reader(run_id) as r:
            info = r.code_info()
            files = [dataclasses.asdict(f) for f in r.code_files()]
        return {"info": None if info is None else dataclasses.asdict(info), "files": files}

    @api.get("/runs/{run_id}/code/file")
    @json_reply
    def code_file(run_id: str, root: str, path: str) -> dict[str, Any]:
        with reader(run_id) as r:
            text = r.code_file(root, path)
        if text is None:
            raise HTTPException(404, f"run {run_id!r} has no file {root}/{path} in its code snapshot")
        return {"root": root, "path": path, "text": text}

    @api.get("/code-diff")
    @json_reply
    def code_difference(a: str, b: str) -> dict[str, Any]:
        with reader(a) as ra, reader(b) as rb:
            diff = diff_code(ra, rb)
        return dataclasses.asdict(diff) | {"same": diff.same}

    @api.get("/runs/{run_id}/logs")
    @json_reply
    def logs(
        run_id: str,
        component: str | None = None,
        level: str | None = None,
        rank: int | None = None,
        q: str = Query("", max_length=500),
        after: int = 0,
        limit: int = Query(1000, ge=1, le=10_000),
    ) -> dict[str, Any]:
        """Lines after id ``after``, oldest first (a live view passes the last id it has);
        ``level``: that level and above; ``q``: lines containing it (docs/run-store.md#logs)."""
        if level and level.upper() not in LEVELS:
            raise HTTPException(400, f"level must be one of {', '.join(LEVELS)}")
        with reader(run_id) as r:
            require_table(r, "logs", "logs")
            columns = {c["name"] for c in r.rows("PRAGMA table_info(logs)")}
            rows = r.logs(component or None, level or None, q or None, rank, after_id=after, limit=limit)
            return {
                "columns": sorted(columns),
                "logs": rows,
                "summary": r.log_summary() if after == 0 else None,
            }

    return api
