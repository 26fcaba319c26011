"""Rewards -> advantages (docs/algorithms.md#advantages), for one group and then for one batch.

The orchestrator calls, per completed group, ``score_group`` (reward range normalization,
overlong penalty, stage-1 advantages, zero-advantage check), and per assembled batch
``normalize_batch_advantages`` (stage 2). Everything is float64 Python on small lists.

Stage 1 (per group of n rewards), first matching row wins:
  rloo                                   n/(n-1) * (r_i - mean r)   (0 when n == 1)
  dr_grpo                                r_i - mean r
  reinforce_pp or advantage_norm=batch   r_i - mean r  (r_i when n == 1)
  otherwise (grpo/cispo/gspo/sapo)       (r_i - mean r) / (std_ddof1 r + 1e-4)
Stage 2 (reinforce_pp or advantage_norm=batch, never rloo/dr_grpo): whiten over the batch.
Which algorithm/normalization pairs are valid is checked once, by the config schema.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

STD_EPS = 1e-4
ZERO_ADVANTAGE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class AdvantageSettings:
    algorithm: str = "grpo"
    advantage_norm: str = "group"
    discard_group_zero_advantage: bool = True
    overlong_penalty_factor: float = 0.0
    overlong_buffer_tokens: int = 256
    max_tokens: int = 3700
    normalize_rewards_to_range: bool = False

    @classmethod
    def from_config(cls, cfg: Any) -> AdvantageSettings:
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    @property
    def batch_whitening(self) -> bool:
        return self.algorithm not in {"rloo", "dr_grpo"} and (
            self.algorithm == "reinforce_pp" or self.advantage_norm == "batch"
        )


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs)


def _std_ddof1(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def group_advantages(rewards: Sequence[float], algorithm: str, advantage_norm: str) -> list[float]:
    """Stage-1 advantages of one group (see the module docstring for the table)."""
    if not rewards:
        raise ValueError("a group needs at least one reward")
    r = [float(x) for x in rewards]
    n = len(r)
    mean = _mean(r)
    if algorithm == "rloo":
        return [0.0] * n if n == 1 else [n / (n - 1) * (x - mean) for x in r]
    if algorithm == "dr_grpo":
        return [x - mean for x in r]
    if algorithm == "reinforce_pp" or advantage_norm == "batch":
        return r if n == 1 else [x - mean for x in r]
    std = _std_ddof1(r)
    return [(x - mean) / (std + STD_EPS) for x in r]


def normalize_batch_advantages(advantages: Sequence[float], settings: AdvantageSettings) -> list[float]:
    """Stage 2: whiten over all samples of the batch when the settings ask for it, else unchanged."""
    a = [float(x) for x in advantages]
    if not settings.batch_whitening or not a:
        return a
    mean = _mean(a)
    std = _std_ddof1(a)
    return [(x - mean) / (std + STD_EPS) for x in a]


def is_zero_advantage_group(advantages: Sequence[float], tolerance: float = ZERO_ADVANTAGE_TOLERANCE) -> bool:
    """True when n > 1 and every advantage is within ``tolerance`` of the first (no signal)."""
    return len(advantages) > 1 and all(abs(a - advantages[0]) <= tolerance for a in advantages)


def overlong_penalty(num_completion_tokens: int, max_tokens: int, factor: float, buffer_tokens: int) -> float:
    """Soft length penalty (<= 0) added to the reward (DAPO-style ramp over the last buffer tokens).

    ``num_completion_tokens`` counts model-sampled tokens (loss-mask 1) over all turns, so a
    single-turn rollout is just the one-turn case; in multi-turn it can exceed ``max_tokens``
    (per-turn cap), and the penalty is then not bounded by ``factor`` (as in Telescope).
    """
    if factor <= 0:
        return 0.0
    excess = num_completion_tokens - (max_tokens - buffer_tokens)
    return min(-factor * excess / buffer_tokens, 0.0) if excess > 0 else 0.0


def normalize_reward(reward: float, reward_min: float | None, reward_max: float | None) -> float:
    """Affine map of an environment's reward range onto [0, 1]; unchanged when the range is unset.

    Telescope only uses ``reward_min``/``reward_max`` for dashboard colouring; refractor applies
    this map before advantages when ``normalize_rewards_to_range`` is on, so environments with
    different reward scales weigh alike in batch-level normalization and in rloo/dr_grpo.
    """
    if reward_min is None or reward_max is None:
        return float(reward)
    return (float(reward) - reward_min) / (reward_max - reward_min)


@dataclass(frozen=True)
class GroupScores:
    rewards: list[float]  # after range normalization and the overlong penalty
    advantages: list[float]  # stage 1
    zero_advantage: bool  # discard when settings.discard_group_zero_advantage


def score_group(
    rewards: Sequence[float],
    num_completion_tokens: Sequence[int],
    settings: AdvantageSettings,
    *,
    reward_min: float | None = None,
    reward_max: float | None = None,
) -> GroupScores:
    """Rewards of one group (one environment) -> shaped rewards and stage-1 advantages.

    Same path for single- and multi-turn rollouts; ``num_completion_tokens[i]`` is the number of
    model-sampled tokens of rollout i. ``zero_advantage`` is only set when discarding is enabled.
    """
    if len(rewards) != len(num_completion_tokens):
        raise ValueError(f"{len(rewards)} rewards but {len(num_completion_tokens)} completion lengths")
    shaped = []
    for r, length in zip(rewards, num_completion_tokens, strict=True):
        if settings.normalize_rewards_to_range:
            r = normalize_reward(r, reward_min, reward_max)
        r += overlong_penalty(
            length, settings.max_tokens, settings.overlong_penalty_factor, settings.overlong_buffer_tokens
        )
        shaped.append(float(r))
    adv = group_advantages(shaped, settings.algorithm, settings.advantage_norm)
    zero = settings.discard_group_zero_advantage and is_zero_advantage_group(adv)
    return GroupScores(rewards=shaped, advantages=adv, zero_advantage=zero)
