"""Advantage estimators, batch whitening, zero-advantage detection, reward shaping (float64 formulas)."""

from __future__ import annotations

import numpy as np
import pytest

from refractor.algorithms import (
    AdvantageSettings,
    group_advantages,
    is_zero_advantage_group,
    normalize_batch_advantages,
    normalize_reward,
    overlong_penalty,
    score_group,
)
from refractor.config import load_config

REWARDS = [0.0, 1.0, 0.5, 1.0, 0.0, 0.25]


def expected_stage1(r, algorithm, norm):
    r = np.asarray(r, dtype=np.float64)
    n = len(r)
    if algorithm == "rloo":  # reward minus the mean of the other samples
        return np.zeros(n) if n == 1 else np.array([r[i] - np.delete(r, i).mean() for i in range(n)])
    if algorithm == "dr_grpo":
        return r - r.mean()
    if algorithm == "reinforce_pp" or norm == "batch":
        return r.copy() if n == 1 else r - r.mean()
    std = r.std(ddof=1) if n > 1 else 0.0
    return (r - r.mean()) / (std + 1e-4)


@pytest.mark.parametrize("rewards", [REWARDS, [3.0], [2.0, -1.0], [1.0, 1.0, 1.0]])
@pytest.mark.parametrize(
    "algorithm,norm",
    [
        ("grpo", "group"),
        ("grpo", "batch"),
        ("rloo", "group"),
        ("reinforce_pp", "batch"),
        ("dr_grpo", "group"),
        ("cispo", "group"),
        ("cispo", "batch"),
        ("gspo", "group"),
        ("gspo", "batch"),
        ("sapo", "group"),
        ("sapo", "batch"),
    ],
)
def test_stage1_matches_formula(rewards, algorithm, norm):
    got = group_advantages(rewards, algorithm, norm)
    np.testing.assert_allclose(got, expected_stage1(rewards, algorithm, norm), rtol=1e-12, atol=1e-12)


def test_rloo_is_leave_one_out():
    a = group_advantages([1.0, 0.0, 0.0, 0.0], "rloo", "group")
    assert a[0] == pytest.approx(1.0) and a[1] == pytest.approx(-1 / 3)


@pytest.mark.parametrize(
    "algorithm,norm,whiten",
    [
        ("grpo", "group", False),
        ("grpo", "batch", True),
        ("reinforce_pp", "batch", True),
        ("rloo", "group", False),
        ("dr_grpo", "group", False),
        ("cispo", "batch", True),
        ("gspo", "group", False),
        ("sapo", "batch", True),
    ],
)
def test_stage2_batch_whitening(algorithm, norm, whiten):
    settings = AdvantageSettings(algorithm=algorithm, advantage_norm=norm)
    a = np.array([0.5, -0.2, 1.3, 0.0, -0.9, 0.4])
    got = normalize_batch_advantages(a.tolist(), settings)
    want = (a - a.mean()) / (a.std(ddof=1) + 1e-4) if whiten else a
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert normalize_batch_advantages([], settings) == []


def test_stage2_single_sample_is_zero_not_nan():
    assert normalize_batch_advantages(
        [2.5], AdvantageSettings(algorithm="reinforce_pp", advantage_norm="batch")
    ) == [0.0]


def test_zero_advantage_detection():
    assert is_zero_advantage_group([0.0, 0.0, 0.0])
    assert is_zero_advantage_group([0.3, 0.3 + 5e-10])  # within the 1e-9 tolerance
    assert not is_zero_advantage_group([0.3, 0.3 + 2e-9])
    assert not is_zero_advantage_group([0.0])  # n = 1 is never discarded
    grpo = group_advantages([1.0, 1.0, 1.0, 1.0], "grpo", "group")
    assert is_zero_advantage_group(grpo)


@pytest.mark.parametrize(
    "length,expected",
    [
        (0, 0.0),
        (744, 0.0),
        (800, 0.0),
        (801, -0.5 * 1 / 200),
        (900, -0.5 * 100 / 200),
        (1000, -0.5),
        (1200, -1.0),
    ],
)
def test_overlong_penalty_ramp(length, expected):
    # max_tokens 1000, buffer 200: penalty starts after 800 tokens, reaches -factor at 1000,
    # keeps going beyond
    assert overlong_penalty(length, max_tokens=1000, factor=0.5, buffer_tokens=200) == pytest.approx(expected)
    assert overlong_penalty(length, max_tokens=1000, factor=0.0, buffer_tokens=200) == 0.0


def test_reward_range_normalization():
    assert normalize_reward(5.0, 0.0, 10.0) == 0.5
    assert normalize_reward(-1.0, -1.0, 1.0) == 0.0
    assert normalize_reward(3.0, None, 10.0) == 3.0


def test_score_group_pipeline():
    settings = AdvantageSettings(
        algorithm="dr_grpo",
        overlong_penalty_factor=1.0,
        overlong_buffer_tokens=100,
        max_tokens=1000,
        normalize_rewards_to_range=True,
    )
    scores = score_group([10.0, 0.0, 5.0], [950, 10, 1000], settings, reward_min=0.0, reward_max=10.0)
    shaped = [1.0 - 0.5, 0.0, 0.5 - 1.0]
    assert scores.rewards == pytest.approx(shaped)
    np.testing.assert_allclose(scores.advantages, np.array(shaped) - np.mean(shaped), atol=1e-12)
    assert not scores.zero_advantage
    flat = score_group([1.0, 1.0], [5, 5], AdvantageSettings())
    assert flat.zero_advantage and flat.advantages == [0.0, 0.0]
    kept = score_group([1.0, 1.0], [5, 5], AdvantageSettings(discard_group_zero_advantage=False))
    assert not kept.zero_advantage
    with pytest.raises(ValueError, match="completion lengths"):
        score_group([1.0], [1, 2], AdvantageSettings())


def test_settings_from_config():
    cfg = load_config(
        None,
        {
            "environments": [{"name": "countdown"}],
            "algorithm": "reinforce_pp",
            "advantage_norm": "batch",
            "overlong_penalty_factor": 0.2,
        },
    )
    s = AdvantageSettings.from_config(cfg)
    assert (s.algorithm, s.advantage_norm, s.overlong_penalty_factor, s.max_tokens) == (
        "reinforce_pp",
        "batch",
        0.2,
        cfg.max_tokens,
    )
    assert s.batch_whitening and not s.normalize_rewards_to_range
