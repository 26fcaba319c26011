"""pass@k and pass^k (docs/orchestrator.md#passk), the ``pass_k`` entry of an eval, and per-eval
aggregation.

Config (``evals[].pass_k``): ``{"at_k": {"metrics": [...], "k": [...]}, "pow_k": {...}}``. A section
without ``k`` means ``k: [1]``; a section given as a list (or one int) is the list of k. A section
without ``metrics`` (or with an empty list) covers every metric the eval reports: naming no metric
and getting no number is never what a user wants (docs/config.md#deliberate-differences).
Every prompt gets ``K = max k`` completions (1 when no k is configured).

Estimators, for one prompt with ``n`` valid completions of which ``c`` have ``metric > 0``:

* ``pass@k = 1 - C(n-c, k) / C(n, k)``: the unbiased estimate of "at least one of k independent
  completions is correct" (Chen et al., 2021);
* ``pass^k = C(c, k) / C(n, k)``: the unbiased estimate of "all of k independent completions are
  correct" (tau-bench).

Both use *all* n completions, not only the first k valid ones (which would make ``n = k``, each
prompt a single 0/1 draw; docs/config.md#deliberate-differences): the expectation is the same, but
using every completion lowers the variance whenever ``n > k`` (e.g. pass@1 with K = 8 becomes the
mean accuracy over 8 completions instead of the correctness of the first one). Binomials are
exact Python integers, so there is no overflow or log-space rounding for any n.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from math import comb
from typing import Any

SECTIONS = {"at_k": "pass@", "pow_k": "pass^"}


@dataclass(frozen=True)
class PassKSection:
    ks: tuple[int, ...]
    metrics: tuple[str, ...] = ()  # empty: every metric


@dataclass(frozen=True)
class PassKSpec:
    sections: dict[str, PassKSection] = field(default_factory=dict)  # "at_k" / "pow_k"

    @property
    def num_completions(self) -> int:
        """K: completions per prompt."""
        return max((k for s in self.sections.values() for k in s.ks), default=1)


def _parse_ks(value: Any, where: str) -> tuple[int, ...]:
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(values, list | tuple) or not values:
        raise ValueError(f"{where}: k must be a positive integer or a non-empty list of them, got {value!r}")
    for k in values:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{where}: every k must be an integer >= 1, got {k!r}")
    return tuple(sorted(set(values)))


def parse_pass_k(raw: Mapping[str, Any] | None, where: str = "pass_k") -> PassKSpec:
    """Validate an eval's ``pass_k`` entry; errors name the offending key."""
    sections: dict[str, PassKSection] = {}
    for key, value in (raw or {}).items():
        if key not in SECTIONS:
            raise ValueError(
                f"{where}: unknown key {key!r}; expected 'at_k' (pass@k) and/or 'pow_k' (pass^k)"
            )
        if not isinstance(value, Mapping):
            sections[key] = PassKSection(_parse_ks(value, f"{where}.{key}"))
            continue
        unknown = set(value) - {"k", "metrics"}
        if unknown:
            raise ValueError(f"{where}.{key}: unknown key(s) {sorted(unknown)}; expected 'k' and 'metrics'")
        metrics = value.get("metrics") or []
        if not isinstance(metrics, list | tuple) or not all(isinstance(m, str) for m in metrics):
            raise ValueError(f"{where}.{key}.metrics must be a list of metric names, got {metrics!r}")
        sections[key] = PassKSection(_parse_ks(value.get("k", [1]), f"{where}.{key}.k"), tuple(metrics))
    return PassKSpec(sections)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n completions, c of them correct (needs n >= k)."""
    _check(n, c, k)
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_pow_k(n: int, c: int, k: int) -> float:
    """Unbiased pass^k (all k correct) from n completions, c of them correct (needs n >= k)."""
    _check(n, c, k)
    return comb(c, k) / comb(n, k)


def _check(n: int, c: int, k: int) -> None:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")


ESTIMATORS = {"at_k": pass_at_k, "pow_k": pass_pow_k}


@dataclass
class EvalAggregate:
    metrics: dict[str, float]  # "<metric>" means, "pass@k/<metric>", "pass^k/<metric>"
    per_prompt: list[dict[str, float]]  # the pass values of each prompt (written into its completions)
    num_prompts: int
    num_completions: int  # valid ones
    num_failed: int


def aggregate(completions: Sequence[Sequence[Mapping[str, float] | None]], spec: PassKSpec) -> EvalAggregate:
    """Aggregate one eval run. ``completions[i]`` holds prompt i's completions: their metrics, or
    None for a completion that failed (prompt too long, server or scoring error).

    Means are over valid completions. A prompt enters pass@k / pass^k only with at least k valid
    completions (fewer cannot estimate it); a completion lacking the metric counts as incorrect.
    """
    valid = [[m for m in prompt if m is not None] for prompt in completions]
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for prompt in valid:
        for metrics in prompt:
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + float(value)
                counts[name] = counts.get(name, 0) + 1
    out = {name: sums[name] / counts[name] for name in sums}
    per_prompt: list[dict[str, float]] = [{} for _ in valid]
    for key, section in spec.sections.items():
        names = section.metrics or tuple(sums)
        for k in section.ks:
            for name in names:
                label = f"{SECTIONS[key]}{k}/{name}"
                values = []
                for prompt, mine in zip(valid, per_prompt, strict=True):
                    if len(prompt) < k:
                        continue
                    correct = sum(1 for m in prompt if float(m.get(name, 0.0)) > 0)
                    mine[label] = ESTIMATORS[key](len(prompt), correct, k)
                    values.append(mine[label])
                if values:
                    out[label] = sum(values) / len(values)
    total = sum(len(p) for p in completions)
    n_valid = sum(len(p) for p in valid)
    return EvalAggregate(out, per_prompt, len(completions), n_valid, total - n_valid)
