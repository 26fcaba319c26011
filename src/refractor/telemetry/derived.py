"""What the dashboard derives from the stored rollouts and step metrics that the orchestrator does
not store: histograms and distributions over steps of rollout fields, a step's zero-advantage
breakdown, the trainer's time shares. The per-step rollout metrics recomputed over a choice of
environments are in :mod:`refractor.telemetry.rollout_stats`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from refractor.telemetry.query import RunReader

# what a histogram may be taken of: name -> SQL expression over the rollouts table
DISTRIBUTION_FIELDS = {
    "reward": "reward",
    "advantage": "advantage",
    "completion_tokens": "completion_tokens",
    "prompt_tokens": "prompt_tokens",
    "off_policy_steps": "off_policy_steps",
}


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
