"""pass@k / pass^k against brute force over every k-subset of the n completions (float64), the
pass_k entry's parsing, and the per-eval aggregation rules."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from refractor.evals.passk import PassKSection, PassKSpec, aggregate, parse_pass_k, pass_at_k, pass_pow_k


def brute_force(n: int, c: int, k: int) -> tuple[float, float]:
    """Over all C(n, k) subsets of k completions: the fraction with any correct, and with all correct."""
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    any_ok = np.array([max(s) for s in subsets], dtype=np.float64)
    all_ok = np.array([min(s) for s in subsets], dtype=np.float64)
    return float(any_ok.mean()), float(all_ok.mean())


@pytest.mark.parametrize("n", [1, 2, 5, 8, 11])
def test_estimators_equal_the_subset_average(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            at, pow_ = brute_force(n, c, k)
            assert pass_at_k(n, c, k) == pytest.approx(at, abs=1e-12), (n, c, k)
            assert pass_pow_k(n, c, k) == pytest.approx(pow_, abs=1e-12), (n, c, k)


def test_large_n_stays_exact_where_float_binomials_overflow():
    # C(2000, 1000) ~ 1e600 overflows float64; the estimator uses exact integers
    n = 2000
    c = 3
    k = 1000
    expected = 1.0 - np.prod([(n - c - i) / (n - i) for i in range(k)], dtype=np.float64)
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12)
    assert pass_pow_k(n, c, k) == 0.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_unbiased_over_all_completions_differs_from_the_first_k():
    """Every completion counts, not only the first k (docs/config.md#deliberate-differences): with
    n > k the estimate differs from scoring the first k completions."""
    completions = [[{"correct": v} for v in (0.0, 1.0, 1.0, 0.0)]]
    spec = parse_pass_k({"at_k": {"metrics": ["correct"], "k": [1, 2]}, "pow_k": {"k": [2]}})
    out = aggregate(completions, spec).metrics
    assert out["pass@1/correct"] == pytest.approx(0.5)  # first-k-only would say 0.0
    assert out["pass@2/correct"] == pytest.approx(1 - 1 / 6)
    assert out["pass^2/correct"] == pytest.approx(1 / 6)
    assert out["correct"] == pytest.approx(0.5)


def test_parse_defaults_and_errors():
    assert parse_pass_k({}).num_completions == 1
    spec = parse_pass_k({"at_k": {"metrics": ["correct"]}, "pow_k": [4, 2]})
    assert spec.sections["at_k"] == PassKSection((1,), ("correct",))
    assert spec.sections["pow_k"] == PassKSection((2, 4), ())
    assert spec.num_completions == 4
    assert parse_pass_k({"at_k": 3}).sections["at_k"].ks == (3,)
    for bad, match in [
        ({"at": [1]}, "unknown key 'at'"),
        ({"at_k": {"k": [0]}}, "k must be an integer >= 1"),
        ({"at_k": {"k": []}}, "non-empty"),
        ({"at_k": {"ks": [1]}}, r"unknown key\(s\) \['ks'\]"),
        ({"pow_k": {"metrics": "correct"}}, "list of metric names"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_pass_k(bad)


def test_aggregate_skips_failed_completions_and_short_prompts():
    spec = PassKSpec({"at_k": PassKSection((1, 3)), "pow_k": PassKSection((3,), ("correct",))})
    completions = [
        [{"correct": 1.0, "level": 2.0}, {"correct": 0.0, "level": 2.0}, {"correct": 1.0, "level": 2.0}],
        [{"correct": 0.0, "level": 5.0}, None, {"correct": 1.0, "level": 5.0}],  # one failed: n = 2 < 3
        [None, None, None],
    ]
    agg = aggregate(completions, spec)
    assert (agg.num_prompts, agg.num_completions, agg.num_failed) == (3, 5, 4)
    m = agg.metrics
    assert m["correct"] == pytest.approx(3 / 5) and m["level"] == pytest.approx((3 * 2 + 2 * 5) / 5)
    assert m["pass@1/correct"] == pytest.approx((2 / 3 + 1 / 2) / 2)  # prompts 0 and 1 (n >= 1)
    assert m["pass@3/correct"] == 1.0  # only prompt 0 has 3 valid completions
    assert m["pass^3/correct"] == 0.0
    assert m["pass@1/level"] == 1.0 and "pass^3/level" not in m  # metrics default to all; pow_k names one
    assert agg.per_prompt[0]["pass@3/correct"] == 1.0 and "pass@3/correct" not in agg.per_prompt[1]
    assert agg.per_prompt[2] == {}
