"""Per-step metrics derived from the stored rollouts, in SQL, for the dashboard.

The orchestrator already stores the derived rollout metrics of every step (docs/metrics.md,
:func:`refractor.telemetry.metrics.rollout_step_metrics`); these queries recompute a subset of
them over any selection of environments (the dashboard's environment filter), plus the
distributions the stored metrics cannot give (histograms, distribution over steps). Definitions
match :mod:`refractor.telemetry.metrics`: sample std (ddof 1, 0 for one value), percentages 0..100,
rank Gini per group averaged over the groups where it is defined.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from refractor.telemetry.metrics import gini
from refractor.telemetry.query import RunReader

# what a histogram may be taken of: name -> SQL expression over the rollouts table
DISTRIBUTION_FIELDS = {
    "reward": "reward",
    "advantage": "advantage",
    "completion_tokens": "completion_tokens",
    "prompt_tokens": "prompt_tokens",
    "off_policy_steps": "off_policy_steps",
}
_STATS = {
    "reward_sum": "reward",
    "advantage": "advantage",
    "length_prompt": "prompt_tokens",
    "length_completion": "completion_tokens",
    "length_sum": "(prompt_tokens + completion_tokens)",
}


@dataclass(frozen=True)
class MetricRange:
    """An environment's range of one sample metric (its ``metrics_ranges`` entry): a value ``v``
    normalises to ``(v - lo) / (hi - lo)``, or to ``1`` minus that when ``invert`` (lower is better),
    not clipped, so 0 is the worst end and 1 the best (the Rollouts page's colours)."""

    lo: float = 0.0
    hi: float = 1.0
    invert: bool = False


def metric_ranges(meta: Mapping[str, Any]) -> dict[str, dict[str, MetricRange]]:
    """{environment: {sample metric: range}} from the run's ``environments`` meta record. A metric
    without a usable range (none, or ``max`` not above ``min``) keeps [0, 1], the Rollouts page's
    default, which leaves its values as they are."""
    out: dict[str, dict[str, MetricRange]] = {}
    for env in meta.get("environments") or []:
        ranges = {}
        for name, r in (env.get("metrics_ranges") or {}).items():
            lo, hi = r.get("min"), r.get("max")
            if isinstance(lo, int | float) and isinstance(hi, int | float) and hi > lo:
                ranges[name] = MetricRange(float(lo), float(hi), bool(r.get("invert", False)))
        out[env["name"]] = ranges
    return out


def _where(envs: list[str] | None, status: str = "'kept'", since: int | None = None) -> tuple[str, list[Any]]:
    """Rows of a status (and environments, and steps after ``since``), in the column order of the
    ``rollouts_step_stats`` index (schema 4), which holds every column these queries read."""
    clause = f"status = {status}"
    args: list[Any] = []
    if envs:
        clause += f" AND env IN ({','.join('?' * len(envs))})"
        args += envs
    if since is not None:
        clause += " AND step > ?"
        args.append(since)
    return clause, args


def _std(n: int, total: float, squares: float) -> float:
    if n < 2:
        return 0.0
    mean = total / n
    return math.sqrt(max(0.0, (squares - n * mean * mean) / (n - 1)))


def derived_step_metrics(
    reader: RunReader,
    envs: list[str] | None = None,
    since: int | None = None,
    ranges: dict[str, dict[str, MetricRange]] | None = None,
) -> dict[int, dict[str, float]]:
    """{step: {name: value}} over the kept rollouts of ``envs`` (all when None) of the steps after
    ``since`` (all when None), plus the counts of discarded and cancelled rollouts by reason
    (``discarded_<reason>_count``). With ``ranges`` the sample metrics' statistics (``reward_<name>_*``)
    are of each value normalised by its environment's range (:class:`MetricRange`)."""
    where, args = _where(envs, since=since)
    columns = ", ".join(
        f"AVG({e}) AS {k}_mean, MIN({e}) AS {k}_min, MAX({e}) AS {k}_max, "
        f"SUM({e}) AS {k}_sum, SUM({e} * {e}) AS {k}_sq"
        for k, e in _STATS.items()
    )
    out: dict[int, dict[str, float]] = defaultdict(dict)
    sql = (
        f"SELECT step, COUNT(*) AS n, {columns}, "
        "100.0 * SUM(stop_reason = 'length') / COUNT(*) AS stop_reason_length_pct, "
        "AVG(off_policy_steps) AS off_policy_steps_mean "
        f"FROM rollouts WHERE {where} GROUP BY step"
    )
    for r in reader.rows(sql, args):
        m = out[r["step"]]
        m["kept_count"] = float(r["n"])
        for k in _STATS:
            m[f"{k}_mean"] = r[f"{k}_mean"]
            m[f"{k}_std"] = _std(r["n"], r[f"{k}_sum"], r[f"{k}_sq"])
            m[f"{k}_min"] = r[f"{k}_min"]
            m[f"{k}_max"] = r[f"{k}_max"]
        m["stop_reason_length_pct"] = r["stop_reason_length_pct"]
        m["off_policy_steps_mean"] = r["off_policy_steps_mean"]
    for r in _sample_metric_stats(reader, envs, since, ranges):
        m = out[r["step"]]
        prefix = f"reward_{r['name']}"
        m[f"{prefix}_mean"] = r["mean"]
        m[f"{prefix}_std"] = _std(r["n"], r["total"], r["sq"])
        m[f"{prefix}_min"] = r["lo"]
        m[f"{prefix}_max"] = r["hi"]
    for name, by_step in _group_ginis(reader, where, args).items():
        for step, value in by_step.items():
            out[step][name] = value
    drop_where, drop_args = _where(envs, "?", since)
    for status, prefix in (("discarded", "discarded"), ("cancelled", "canceled")):
        sql = f"SELECT step, reason, COUNT(*) AS n FROM rollouts WHERE {drop_where} GROUP BY step, reason"
        for r in reader.rows(sql, [status, *drop_args]):
            m = out[r["step"]]
            m[f"{prefix}_{r['reason'] or 'unknown'}_count"] = float(r["n"])
            m[f"{prefix}_count"] = m.get(f"{prefix}_count", 0.0) + r["n"]
    for m in out.values():
        for prefix in ("discarded", "canceled"):
            m.setdefault(f"{prefix}_count", 0.0)
        dropped = m["discarded_count"]
        if dropped:
            m["discarded_zero_advantage_pct"] = 100.0 * m.get("discarded_zero_advantage_count", 0.0) / dropped
            m["discarded_max_async_pct"] = 100.0 * m.get("discarded_max_async_count", 0.0) / dropped
    return dict(sorted(out.items()))


def _sample_metric_stats(
    reader: RunReader,
    envs: list[str] | None,
    since: int | None,
    ranges: dict[str, dict[str, MetricRange]] | None = None,
) -> list[dict[str, Any]]:
    """Per step and sample metric of the kept rollouts (of ``envs``): count, mean, sum, sum of
    squares, min and max (the ``sample_metrics`` table; joined to the rollouts for their
    environment only when filtered or normalised). With ``ranges``, of the normalised values: each
    row's range is looked up by (environment, metric) in a VALUES table, [0, 1] when it has none."""
    clauses = ["m.status = 'kept'"]
    args: list[Any] = []
    join = ""
    value = "m.value"
    if envs or ranges is not None:
        join = "JOIN rollouts AS r ON r.rollout_id = m.rollout_id"
    if ranges is not None:
        rows = [(e, n, r.lo, r.hi - r.lo, int(r.invert)) for e, by in ranges.items() for n, r in by.items()]
        values = ", ".join(["(NULL, NULL, 0.0, 1.0, 0)"] + ["(?, ?, ?, ?, ?)"] * len(rows))
        join = f"{join} LEFT JOIN (VALUES {values}) AS g ON g.column1 = r.env AND g.column2 = m.name"
        args += [x for row in rows for x in row]
        t = "(m.value - COALESCE(g.column3, 0.0)) / COALESCE(g.column4, 1.0)"
        value = f"(CASE WHEN g.column5 THEN 1.0 - {t} ELSE {t} END)"
    if envs:
        clauses.append(f"r.env IN ({','.join('?' * len(envs))})")
        args += envs
    if since is not None:
        clauses.append("m.step > ?")
        args.append(since)
    return reader.rows(
        f"SELECT m.step AS step, m.name AS name, COUNT(m.value) AS n, AVG({value}) AS mean, "
        f"SUM({value}) AS total, SUM({value} * {value}) AS sq, MIN({value}) AS lo, MAX({value}) AS hi "
        f"FROM sample_metrics AS m {join} WHERE {' AND '.join(clauses)} GROUP BY m.step, m.name",
        args,
    )


def _group_ginis(reader: RunReader, where: str, args: list[Any]) -> dict[str, dict[int, float]]:
    """Per step, the mean over its groups of the rank Gini (:func:`refractor.telemetry.metrics.gini`,
    the orchestrator's own definition) of the rewards and of the completion lengths. One pass over
    the covering index, in its order (a group's rows are contiguous: one step, one environment);
    sorting each small group in Python is far cheaper than SQL window functions here."""
    rows = reader.columns(
        f"SELECT step, group_id, reward, completion_tokens FROM rollouts WHERE {where} "
        "ORDER BY step, env, group_id",
        args,
    )
    steps, groups = rows["step"], rows["group_id"]
    found: dict[str, dict[int, list[float]]] = {"reward_gini_mean": {}, "group_length_gini_mean": {}}
    begin = 0
    while begin < len(steps):
        end = begin
        while end < len(steps) and steps[end] == steps[begin] and groups[end] == groups[begin]:
            end += 1
        for name, column in (("reward_gini_mean", "reward"), ("group_length_gini_mean", "completion_tokens")):
            g = gini([float(v) for v in rows[column][begin:end] if v is not None])
            if g is not None:
                found[name].setdefault(steps[begin], []).append(g)
        begin = end
    return {name: {step: sum(v) / len(v) for step, v in by_step.items()} for name, by_step in found.items()}


def zero_advantage_breakdown(reader: RunReader, step: int) -> dict[str, float]:
    """Of one step's zero-advantage groups: the share where every reward is 0, where every reward
    is positive, and their mean reward (empty when the step discarded none)."""
    rows = reader.rows(
        "SELECT group_id, MIN(reward) AS lo, MAX(reward) AS hi, SUM(reward) AS total, COUNT(*) AS n "
        "FROM rollouts WHERE step = ? AND status = 'discarded' AND reason = 'zero_advantage' "
        "GROUP BY group_id",
        (step,),
    )
    if not rows:
        return {}
    groups = len(rows)
    return {
        "groups": float(groups),
        "all_zero_pct": 100.0 * sum(r["lo"] == 0 and r["hi"] == 0 for r in rows) / groups,
        "all_positive_pct": 100.0 * sum(r["lo"] > 0 for r in rows) / groups,
        "mean_reward": sum(r["total"] for r in rows) / sum(r["n"] for r in rows),
    }


def histogram(
    reader: RunReader, field: str, step: int | None = None, bins: int = 30, envs: list[str] | None = None
) -> dict[str, Any]:
    """Counts of ``field`` over the kept rollouts of one step (every step when None) in equal bins."""
    expr = DISTRIBUTION_FIELDS[field]
    where, args = _where(envs)
    if step is not None:
        where += " AND step = ?"
        args.append(step)
    lo, hi = _range(reader, expr, where, args)
    if lo is None:
        return {"field": field, "edges": [], "counts": []}
    width = (hi - lo) / bins or 1.0
    counts = [0] * bins
    sql = (
        f"SELECT MIN(CAST(({expr} - ?) / ? AS INTEGER), ?) AS b, COUNT(*) AS n "
        f"FROM rollouts WHERE {where} AND {expr} IS NOT NULL GROUP BY b"
    )
    for r in reader.rows(sql, [lo, width, bins - 1, *args]):
        counts[r["b"]] = r["n"]
    return {"field": field, "edges": [lo + i * width for i in range(bins + 1)], "counts": counts}


def distribution_over_steps(
    reader: RunReader, field: str, bins: int = 24, max_columns: int = 200, envs: list[str] | None = None
) -> dict[str, Any]:
    """A 2-D histogram: columns of steps (consecutive steps merged past ``max_columns``), rows of
    equal bins of ``field`` over its range in the whole run; ``counts[column][bin]``."""
    expr = DISTRIBUTION_FIELDS[field]
    where, args = _where(envs)
    lo, hi = _range(reader, expr, where, args)
    last = reader.rows(f"SELECT MAX(step) AS s FROM rollouts WHERE {where}", args)[0]["s"]
    if lo is None or last is None:
        return {"field": field, "steps": [], "edges": [], "counts": []}
    stride = max(1, math.ceil((last + 1) / max_columns))
    width = (hi - lo) / bins or 1.0
    columns = (last // stride) + 1
    counts = [[0] * bins for _ in range(columns)]
    sql = (
        f"SELECT step / ? AS c, MIN(CAST(({expr} - ?) / ? AS INTEGER), ?) AS b, COUNT(*) AS n "
        f"FROM rollouts WHERE {where} AND {expr} IS NOT NULL GROUP BY c, b"
    )
    for r in reader.rows(sql, [stride, lo, width, bins - 1, *args]):
        counts[r["c"]][r["b"]] = r["n"]
    return {
        "field": field,
        "steps": [c * stride for c in range(columns)],
        "edges": [lo + i * width for i in range(bins + 1)],
        "counts": counts,
    }


def _range(reader: RunReader, expr: str, where: str, args: list[Any]) -> tuple[float | None, float]:
    row = reader.rows(f"SELECT MIN({expr}) AS lo, MAX({expr}) AS hi FROM rollouts WHERE {where}", args)[0]
    if row["lo"] is None:
        return None, 0.0
    return float(row["lo"]), float(row["hi"])


# the trainer's top-level spans (docs/metrics.md#trainer-spans) and the driver's own phases
TRAINER_PHASES = (
    "data_to_device",
    "ref_logprobs",
    "zero_grad",
    "forward",
    "loss_computation",
    "backward",
    "grad_norm",
    "optimizer",
)
DRIVER_PHASES = ("weight_sync", "waiting_for_data")


def time_shares(reader: RunReader) -> dict[str, dict[str, list[Any]]]:
    """Per step, the share (%) of ``timing_step_total`` spent in each trainer span, in the weight
    sync and waiting for data, and ``idle``: what is left (the trainer waits while rollouts finish,
    packing, the driver's own work). {name: {"steps": [...], "values": [...]}}."""
    names = {f"timing_{p}_total": p for p in TRAINER_PHASES} | {
        "timing_weight_sync_total": "weight_sync",
        "timing_waiting_for_data": "waiting_for_data",
    }
    wanted = [*names, "timing_step_total"]
    marks = ",".join("?" * len(wanted))
    rows = reader.rows(
        f"SELECT step, name, value FROM step_metrics WHERE name IN ({marks}) ORDER BY step", wanted
    )
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r["value"] is not None:
            by_step[r["step"]][r["name"]] = r["value"]
    out: dict[str, dict[str, list[Any]]] = {}
    for step, values in by_step.items():
        total = values.get("timing_step_total")
        if not total or total <= 0:
            continue
        used = 0.0
        for name, phase in names.items():
            if name in values:
                share = 100.0 * values[name] / total
                used += share
                series = out.setdefault(phase, {"steps": [], "values": []})
                series["steps"].append(step)
                series["values"].append(share)
        idle = out.setdefault("idle", {"steps": [], "values": []})
        idle["steps"].append(step)
        idle["values"].append(max(0.0, 100.0 - used))
    return out
