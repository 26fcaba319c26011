"""Derived per-step rollout metrics (names and definitions: docs/metrics.md#rollout-metrics).

One pure function, :func:`rollout_step_metrics`, over plain :class:`RolloutSummary` rows, so the
orchestrator (live rollouts) and the dashboard (rows read from ``run.db``) compute identical
numbers. Conventions: ``*_std`` is the sample standard deviation (ddof = 1; 0 with one value);
percentages are 0..100; Gini is the rank formula ``2·Σ(i·x_(i)) / (n·Σx) − (n+1)/n`` over the
ascending values of one group (groups with ``Σx <= 0`` or one member are skipped), averaged over
groups. Group statistics use the groups present in the rows given.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refractor.records import Rollout


@dataclass(frozen=True)
class RolloutSummary:
    group_id: int
    status: str  # kept | discarded | cancelled | eval
    reason: str = ""
    reward: float = 0.0
    advantage: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stop_reason: str = ""
    off_policy_steps: int = 0
    sample_metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, r: Rollout) -> RolloutSummary:
        return cls(
            r.group_id,
            str(r.status),
            r.reason,
            r.reward,
            r.advantage,
            len(r.prompt_ids),
            r.num_completion_tokens,
            r.stop_reason,
            r.off_policy_steps,
            dict(r.sample_metrics),
        )


def _stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        f"{prefix}_mean": statistics.fmean(values),
        f"{prefix}_std": statistics.stdev(values) if len(values) > 1 else 0.0,
        f"{prefix}_min": float(min(values)),
        f"{prefix}_max": float(max(values)),
    }


def gini(values: Sequence[float]) -> float | None:
    """Rank-based Gini of non-negative values; None when undefined (n < 2 or sum <= 0)."""
    n = len(values)
    total = float(sum(values))
    if n < 2 or total <= 0:
        return None
    xs = sorted(values)
    return 2.0 * sum((i + 1) * x for i, x in enumerate(xs)) / (n * total) - (n + 1) / n


def _by_group(rows: Iterable[RolloutSummary]) -> dict[int, list[RolloutSummary]]:
    groups: dict[int, list[RolloutSummary]] = defaultdict(list)
    for r in rows:
        groups[r.group_id].append(r)
    return groups


def _mean_defined(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(vals) if vals else None


def _population_metrics(rows: list[RolloutSummary], prefix: str) -> dict[str, float]:
    """The metrics computed alike for kept rows (prefix "") and discarded rows ("discarded_")."""
    out: dict[str, float] = {}
    if not rows:
        return out
    out |= _stats(f"{prefix}reward_sum", [r.reward for r in rows])
    for name in sorted({m for r in rows for m in r.sample_metrics}):
        out |= _stats(
            f"{prefix}reward_{name}", [r.sample_metrics[name] for r in rows if name in r.sample_metrics]
        )
    out |= _stats(f"{prefix}advantage", [r.advantage for r in rows])
    out |= _stats(f"{prefix}length_prompt", [r.prompt_tokens for r in rows])
    out |= _stats(f"{prefix}length_completion", [r.completion_tokens for r in rows])
    out |= _stats(f"{prefix}length_sum", [r.prompt_tokens + r.completion_tokens for r in rows])
    out[f"{prefix}stop_reason_length_pct"] = 100.0 * sum(r.stop_reason == "length" for r in rows) / len(rows)
    groups = _by_group(rows)
    lengths = [[float(r.completion_tokens) for r in g] for g in groups.values()]
    ginis = _mean_defined(gini(ls) for ls in lengths)
    if ginis is not None:
        out[f"{prefix}group_length_gini_mean"] = ginis
    ratio = _mean_defined(
        max(ls) / statistics.median(ls) if statistics.median(ls) > 0 else None for ls in lengths
    )
    if ratio is not None:
        out[f"{prefix}group_length_max_median_ratio_mean"] = ratio
    off = [float(r.off_policy_steps) for r in rows]
    out[f"{prefix}off_policy_steps_mean"] = statistics.fmean(off)
    out[f"{prefix}off_policy_steps_std"] = statistics.stdev(off) if len(off) > 1 else 0.0
    if not prefix:
        cv = _mean_defined(
            (statistics.stdev(ls) / statistics.fmean(ls))
            if len(ls) > 1 and statistics.fmean(ls) > 0
            else None
            for ls in lengths
        )
        if cv is not None:
            out["group_length_cv_mean"] = cv
        rg = _mean_defined(gini([r.reward for r in g]) for g in groups.values())
        if rg is not None:
            out["reward_gini_mean"] = rg
    return out


def rollout_step_metrics(rows: Iterable[RolloutSummary]) -> dict[str, float]:
    """Every derived rollout metric of one step from its kept, discarded and cancelled rows."""
    rows = list(rows)
    kept = [r for r in rows if r.status == "kept"]
    discarded = [r for r in rows if r.status == "discarded"]
    cancelled = [r for r in rows if r.status == "cancelled"]
    out = _population_metrics(kept, "")
    out["discarded_count"] = float(len(discarded))
    out["canceled_count"] = float(len(cancelled))
    reasons = Counter(r.reason for r in discarded)
    for reason, n in sorted(reasons.items()):
        out[f"discarded_{reason}_count"] = float(n)
    for reason, n in sorted(Counter(r.reason for r in cancelled).items()):
        out[f"canceled_{reason}_count"] = float(n)
    if discarded:
        out |= _population_metrics(discarded, "discarded_")
        out["discarded_max_async_pct"] = 100.0 * reasons.get("max_async", 0) / len(discarded)
        out["discarded_zero_advantage_pct"] = 100.0 * reasons.get("zero_advantage", 0) / len(discarded)
        zero_groups = list(_by_group(r for r in discarded if r.reason == "zero_advantage").values())
        if zero_groups:
            out["discarded_zero_advantage_all_zero_pct"] = (
                100.0 * sum(all(r.reward == 0 for r in g) for g in zero_groups) / len(zero_groups)
            )
            out["discarded_zero_advantage_all_positive_pct"] = (
                100.0 * sum(all(r.reward > 0 for r in g) for g in zero_groups) / len(zero_groups)
            )
            out["discarded_zero_advantage_mean_reward"] = statistics.fmean(
                r.reward for g in zero_groups for r in g
            )
    return out
