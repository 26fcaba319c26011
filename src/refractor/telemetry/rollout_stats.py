"""Per-step rollout metrics recomputed from the stored rollouts over any choice of environments (the
dashboard's environment filter), with the orchestrator's definitions (docs/metrics.md,
:func:`refractor.telemetry.metrics.rollout_step_metrics`): sample std (ddof 1, 0 for one value),
percentages 0..100, rank Gini per group averaged over the groups where it is defined.

One pass over a run reads partial sums per (step, environment): counts, sums, sums of squares,
minima and maxima, Gini sums and drop counts (:func:`step_partials`). Every choice of environments is
merged from them (:func:`merge`) without reading the run again, so a page switching its environment
filter pays for the pass once. Each query reads the ``rollouts_step_stats`` covering index by
``(status, step)``, so the steps of a live run after ``since`` are a range of it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refractor.telemetry.query import RunReader

# metric prefix -> the rollouts column it is of (and length_sum: prompt plus completion tokens)
_COLUMNS = {
    "reward_sum": "reward",
    "advantage": "advantage",
    "length_prompt": "prompt_tokens",
    "length_completion": "completion_tokens",
}
# the per-group Gini metrics and the rollouts column each is of
_GINIS = {"reward_gini_mean": "reward", "group_length_gini_mean": "completion_tokens"}
_DROPPED = {"discarded": "discarded", "cancelled": "canceled"}  # status -> metric prefix
EVERY = "*"  # the key of every environment's rollouts read together


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


@dataclass
class Moments:
    """Count, sum, sum of squares, minimum and maximum of some values: what their mean, sample std,
    min and max are computed from, and what two sets of values merge by."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf

    def add(self, other: Moments) -> None:
        self.n += other.n
        self.total += other.total
        self.squares += other.squares
        self.lo = min(self.lo, other.lo)
        self.hi = max(self.hi, other.hi)

    def stats(self, prefix: str) -> dict[str, float]:
        mean = self.total / self.n
        std = 0.0
        if self.n > 1:
            std = math.sqrt(max(0.0, (self.squares - self.n * mean * mean) / (self.n - 1)))
        return {
            f"{prefix}_mean": mean,
            f"{prefix}_std": std,
            f"{prefix}_min": self.lo,
            f"{prefix}_max": self.hi,
        }


@dataclass
class EnvStep:
    """What one environment's rollouts of one step add to that step's metrics."""

    kept: int = 0
    stop_length: int = 0  # kept rollouts stopped by the length limit
    off_policy: Moments = field(default_factory=Moments)
    moments: dict[str, Moments] = field(
        default_factory=dict
    )  # _COLUMNS prefixes, length_sum, reward_<sample metric>
    ginis: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum of group Ginis, groups]
    dropped: dict[tuple[str, str], int] = field(default_factory=dict)  # (prefix, reason) -> rollouts


def _moments(row: Mapping[str, Any], key: str) -> Moments:
    return Moments(row[f"{key}_n"], row[f"{key}_sum"], row[f"{key}_sq"], row[f"{key}_lo"], row[f"{key}_hi"])


def _aggregates(key: str, expr: str) -> str:
    return (
        f"COUNT({expr}) AS {key}_n, SUM({expr}) AS {key}_sum, SUM({expr} * {expr}) AS {key}_sq, "
        f"MIN({expr}) AS {key}_lo, MAX({expr}) AS {key}_hi"
    )


def _filter(envs: list[str] | None, since: int | None, table: str = "") -> tuple[str, list[Any]]:
    """The SQL condition on the environments and the steps after ``since`` (after a status one)."""
    clause = ""
    args: list[Any] = []
    if envs is not None:
        clause += f" AND {table}env IN ({','.join('?' * len(envs))})"
        args += envs
    if since is not None:
        clause += f" AND {table}step > ?"
        args.append(since)
    return clause, args


def step_partials(
    reader: RunReader,
    since: int | None = None,
    ranges: dict[str, dict[str, MetricRange]] | None = None,
    envs: list[str] | None = None,
) -> dict[int, dict[str, EnvStep]]:
    """{step: {environment: EnvStep}} of the steps after ``since`` (all when None) of the
    environments ``envs``; with ``envs`` None, of every environment together, as {step: {EVERY:
    EnvStep}} (a merge of one part per step is the cheapest). With ``ranges`` the sample metrics'
    moments are of each value normalised by its environment's range."""
    after, args = _filter(envs, since)
    out: dict[int, dict[str, EnvStep]] = defaultdict(lambda: defaultdict(EnvStep))

    def sample_metrics() -> list[dict[str, Any]]:
        with RunReader(reader.path.parent) as own:
            return _sample_metric_moments(own, envs, since, ranges)

    # The sample metrics' query runs meanwhile on a connection of its own: SQLite works without the
    # GIL, so the two reads share two cores. A commit between the two reads of a live run can only
    # touch its newest steps, which its next refresh reads again.
    with ThreadPoolExecutor(1) as pool:
        sampled = pool.submit(sample_metrics)
        _kept_partials(reader, after, args, out, together=envs is None)
        env, by_env = ("env", "env, ") if envs is not None else (f"'{EVERY}'", "")
        sql = (
            f"SELECT step, {env} AS env, status, reason, COUNT(*) AS n FROM rollouts "
            f"WHERE status IN ('discarded', 'cancelled'){after} GROUP BY step, {by_env}status, reason"
        )
        for r in reader.rows(sql, args):
            out[r["step"]][r["env"]].dropped[(_DROPPED[r["status"]], r["reason"] or "unknown")] = r["n"]
        for r in sampled.result():
            out[r["step"]][r["env"]].moments[f"reward_{r['name']}"] = _moments(r, "v")
    return {step: dict(by_env) for step, by_env in sorted(out.items())}


def _kept_partials(
    reader: RunReader, after: str, args: list[Any], out: dict[int, dict[str, EnvStep]], together: bool
) -> None:
    """The kept rollouts' part of each (step, environment): counts, moments of _COLUMNS and
    length_sum, length stops, off-policy steps and group Ginis, from one read of the covering index
    in its order (a step's environments, and an environment's groups, are contiguous), summed by
    numpy over those runs of rows: cheaper than SQL aggregates, which cost more per row than
    reading the row."""
    rows = reader.columns(
        "SELECT step, env, group_id, reward, advantage, prompt_tokens, completion_tokens, "
        "stop_reason = 'length' AS stop_length, off_policy_steps FROM rollouts "
        f"WHERE status = 'kept'{after} ORDER BY step, env, group_id",
        args,
    )
    if not rows["step"]:
        return
    steps = np.asarray(rows["step"], dtype=np.int64)
    env_names = sorted(set(rows["env"]))
    code = {e: i for i, e in enumerate(env_names)}
    envs = np.asarray([code[e] for e in rows["env"]], dtype=np.int64)
    env_start = np.ones(len(steps), dtype=bool)  # a row that starts a (step, environment)
    env_start[1:] = (steps[1:] != steps[:-1]) | (envs[1:] != envs[:-1])
    pair_start = env_start.copy()  # a row that starts a part (of a step, or of a step's environment)
    if together:
        pair_start[1:] = steps[1:] != steps[:-1]
    firsts = np.flatnonzero(pair_start)
    pair_of_row = np.cumsum(pair_start) - 1
    keys = [(int(steps[i]), EVERY if together else env_names[envs[i]]) for i in firsts]
    columns = {name: np.asarray(rows[c], dtype=np.float64) for name, c in _COLUMNS.items()}  # None: nan
    columns["length_sum"] = columns["length_prompt"] + columns["length_completion"]
    moments = {name: _segment_moments(v, firsts) for name, v in columns.items()}
    off_policy = _segment_moments(np.asarray(rows["off_policy_steps"], dtype=np.float64), firsts)
    kept = np.diff(np.append(firsts, len(steps)))
    stop_length = np.add.reduceat(np.asarray(rows["stop_length"], dtype=np.int64), firsts)
    for p, (step, env) in enumerate(keys):
        part = out[step][env]
        part.kept = int(kept[p])
        part.stop_length = int(stop_length[p])
        part.off_policy = off_policy[p]
        part.moments = {name: m[p] for name, m in moments.items()}
    groups = np.asarray(rows["group_id"], dtype=np.int64)
    for name, column in _GINIS.items():
        values = np.asarray(rows[column], dtype=np.float64)
        sums, counts = _group_ginis(pair_of_row, env_start, groups, values)
        for p in np.flatnonzero(counts):
            step, env = keys[p]
            out[step][env].ginis[name] = [float(sums[p]), int(counts[p])]


def _segment_moments(values: np.ndarray, firsts: np.ndarray) -> list[Moments]:
    """The moments of each run of ``values`` starting at ``firsts`` (nan: no value)."""
    present = ~np.isnan(values)
    n = np.add.reduceat(present.astype(np.int64), firsts)
    x = np.where(present, values, 0.0)
    total = np.add.reduceat(x, firsts)
    squares = np.add.reduceat(x * x, firsts)
    lo = np.minimum.reduceat(np.where(present, values, np.inf), firsts)
    hi = np.maximum.reduceat(np.where(present, values, -np.inf), firsts)
    return [
        Moments(int(n[i]), float(total[i]), float(squares[i]), float(lo[i]), float(hi[i]))
        for i in range(len(firsts))
    ]


def _sample_metric_moments(
    reader: RunReader,
    envs: list[str] | None,
    since: int | None,
    ranges: dict[str, dict[str, MetricRange]] | None,
) -> list[dict[str, Any]]:
    """Per step, environment and sample metric of the kept rollouts: the moments of the values (the
    ``sample_metrics`` rows of each rollout read from the covering index, by their primary key). With
    ``ranges``, of the normalised values: each row's range is looked up by (environment, metric) in a
    VALUES table, [0, 1] when it has none."""
    join = ""
    args: list[Any] = []
    value = "m.value"
    if ranges is not None:
        rows = [(e, n, r.lo, r.hi - r.lo, int(r.invert)) for e, by in ranges.items() for n, r in by.items()]
        values = ", ".join(["(NULL, NULL, 0.0, 1.0, 0)"] + ["(?, ?, ?, ?, ?)"] * len(rows))
        join = f"LEFT JOIN (VALUES {values}) AS g ON g.column1 = r.env AND g.column2 = m.name"
        args += [x for row in rows for x in row]
        t = "(m.value - COALESCE(g.column3, 0.0)) / COALESCE(g.column4, 1.0)"
        value = f"(CASE WHEN g.column5 THEN 1.0 - {t} ELSE {t} END)"
    after, more = _filter(envs, since, "r.")
    args += more
    env, by_env = ("r.env", "r.env, ") if envs is not None else (f"'{EVERY}'", "")
    return reader.rows(
        f"SELECT r.step AS step, {env} AS env, m.name AS name, {_aggregates('v', value)} "
        f"FROM rollouts AS r JOIN sample_metrics AS m ON m.rollout_id = r.rollout_id {join} "
        f"WHERE r.status = 'kept' AND m.status = 'kept'{after} GROUP BY r.step, {by_env}m.name",
        args,
    )


def _group_ginis(
    pair_of_row: np.ndarray, env_start: np.ndarray, groups: np.ndarray, values: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per part (``pair_of_row``): the sum of its groups' rank Ginis of ``values`` and the number of
    groups where the Gini is defined (:func:`refractor.telemetry.metrics.gini`, vectorised: a group
    of n values sorted ascending has ``2 * sum(rank * x) / (n * sum(x)) - (n + 1) / n``, undefined
    when n < 2 or sum(x) <= 0; nan values are left out). A group starts with a new step,
    environment (``env_start``) or group id."""
    group_start = env_start.copy()
    group_start[1:] |= groups[1:] != groups[:-1]
    group_of_row = np.cumsum(group_start) - 1
    pair_of_group = pair_of_row[group_start]
    present = ~np.isnan(values)
    group, value = group_of_row[present], values[present]
    order = np.lexsort((value, group))
    group, value = group[order], value[order]
    size = len(pair_of_group)
    count = np.bincount(group, minlength=size)
    total = np.bincount(group, weights=value, minlength=size)
    rank = np.arange(len(value)) - (np.cumsum(count) - count)[group] + 1
    weighted = np.bincount(group, weights=rank * value, minlength=size)
    defined = (count >= 2) & (total > 0)
    n = count[defined].astype(np.float64)
    ginis = 2.0 * weighted[defined] / (n * total[defined]) - (n + 1.0) / n
    pairs = int(pair_of_row[-1]) + 1
    sums = np.bincount(pair_of_group[defined], weights=ginis, minlength=pairs)
    return sums, np.bincount(pair_of_group[defined], minlength=pairs)


def merge(
    partials: Mapping[int, Mapping[str, EnvStep]], envs: list[str] | None = None
) -> dict[int, dict[str, float]]:
    """{step: {name: value}} over the rollouts of ``envs`` (all when None): the kept rollouts'
    statistics, the counts of discarded and cancelled rollouts by reason (``discarded_<reason>_count``)
    and their totals and shares."""
    out: dict[int, dict[str, float]] = {}
    for step, by_env in partials.items():
        parts = [p for env, p in by_env.items() if envs is None or env in envs]
        if parts:
            out[step] = _metrics(parts[0] if len(parts) == 1 else _combined(parts))
    return out


def _combined(parts: list[EnvStep]) -> EnvStep:
    out = EnvStep()
    for p in parts:
        out.kept += p.kept
        out.stop_length += p.stop_length
        out.off_policy.add(p.off_policy)
        for name, x in p.moments.items():
            out.moments.setdefault(name, Moments()).add(x)
        for name, (total, groups) in p.ginis.items():
            acc = out.ginis.setdefault(name, [0.0, 0])
            acc[0] += total
            acc[1] += groups
        for key, count in p.dropped.items():
            out.dropped[key] = out.dropped.get(key, 0) + count
    return out


def _metrics(part: EnvStep) -> dict[str, float]:
    m: dict[str, float] = {}
    if part.kept:
        m["kept_count"] = float(part.kept)
        m["stop_reason_length_pct"] = 100.0 * part.stop_length / part.kept
        m["off_policy_steps_mean"] = part.off_policy.total / part.off_policy.n
    for name, x in part.moments.items():
        if x.n:
            m |= x.stats(name)
    for name, (total, groups) in part.ginis.items():
        m[name] = total / groups
    dropped = dict.fromkeys(_DROPPED.values(), 0)
    for (prefix, reason), count in part.dropped.items():
        m[f"{prefix}_{reason}_count"] = float(count)
        dropped[prefix] += count
    for prefix, count in dropped.items():
        m[f"{prefix}_count"] = float(count)
    if dropped["discarded"]:
        for reason in ("zero_advantage", "max_async"):
            share = m.get(f"discarded_{reason}_count", 0.0) / dropped["discarded"]
            m[f"discarded_{reason}_pct"] = 100.0 * share
    return m


def derived_step_metrics(
    reader: RunReader,
    envs: list[str] | None = None,
    since: int | None = None,
    ranges: dict[str, dict[str, MetricRange]] | None = None,
) -> dict[int, dict[str, float]]:
    """:func:`merge` of :func:`step_partials`: the metrics of the steps after ``since`` over the
    rollouts of ``envs``."""
    return merge(step_partials(reader, since, ranges, envs), envs)
