"""Scoring a finished rollout safely: a per-rollout timeout, and failures recorded, never raised.

``score_rollout`` is what the orchestrator calls for every finished rollout. A failure comes back
as a typed reason (``DiscardReason.REWARD_ERROR`` or ``REWARD_TIMEOUT``) plus a message for people;
blocking reward code runs off the event loop (:mod:`refractor.envs.runners`).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

from refractor.envs.base import Environment
from refractor.records import DiscardReason, EvalMetricsResult, RewardResult, RolloutState, info_turn

MAX_DETAIL_CHARS = 2000


@dataclass
class ScoreOutcome:
    """Result of scoring one rollout: a result, or ``None`` with why it failed.

    ``reason`` is what the rollout is discarded for; ``detail`` says what happened, e.g.
    ``"reward_error: ValueError: ..."``, ``"reward_timeout: <env> took longer than 2s"`` or
    ``"invalid_reward: total_reward is nan"`` (an invalid result is a ``REWARD_ERROR``).
    """

    result: RewardResult | EvalMetricsResult | None
    reason: DiscardReason | None = None
    detail: str = ""
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.result is not None

    def reward_or_zero(self) -> RewardResult:
        """The result, or a zero reward that carries the failure in metrics and info turns."""
        if isinstance(self.result, RewardResult):
            return self.result
        return RewardResult(
            total_reward=0.0,
            sample_metrics={"reward_failed": 1.0},
            info_turns=[info_turn("reward_failure", self.detail, "stderr")],
        )


def _validate(result: Any, eval_mode: bool) -> str | None:
    """What is wrong with a reward function's result (``None``: nothing); numbers become floats."""
    expected = EvalMetricsResult if eval_mode else RewardResult
    if not isinstance(result, expected):
        return f"invalid_reward: expected {expected.__name__}, got {type(result).__name__}"
    metrics = result.metrics if eval_mode else result.sample_metrics
    if not eval_mode:
        try:
            result.total_reward = float(result.total_reward)
        except (TypeError, ValueError):
            return f"invalid_reward: total_reward {result.total_reward!r} is not a number"
        if not math.isfinite(result.total_reward):
            return f"invalid_reward: total_reward is {result.total_reward}"
    for key, value in list(metrics.items()):
        try:
            metrics[key] = float(value)
        except (TypeError, ValueError):
            return f"invalid_reward: metric {key!r} = {value!r} is not a number"
    return None


async def score_rollout(
    env: Environment,
    state: RolloutState,
    *,
    eos_token: str = "",
    timeout_s: float = 120.0,
    eval_mode: bool = False,
) -> ScoreOutcome:
    """Score a finished rollout with ``env.score`` (or ``env.score_eval``) under a timeout.

    Never raises for reward problems: exceptions, timeouts and malformed results come back as a
    ``ScoreOutcome`` without a result. A timed-out async reward is cancelled; a blocking function
    already running in a thread cannot be stopped and finishes in the background (its result is
    ignored).
    """
    start = time.perf_counter()
    scorer = env.score_eval if eval_mode else env.score
    try:
        result = await asyncio.wait_for(scorer(state, eos_token=eos_token), timeout_s)
    except TimeoutError:
        detail = f"reward_timeout: {env.name} took longer than {timeout_s:g}s"
        return ScoreOutcome(None, DiscardReason.REWARD_TIMEOUT, detail, time.perf_counter() - start)
    except asyncio.CancelledError:
        raise
    except Exception as err:  # any user-code failure becomes a recorded failure
        detail = f"reward_error: {type(err).__name__}: {err}"[:MAX_DETAIL_CHARS]
        return ScoreOutcome(None, DiscardReason.REWARD_ERROR, detail, time.perf_counter() - start)
    problem = _validate(result, eval_mode)
    elapsed = time.perf_counter() - start
    if problem:
        return ScoreOutcome(None, DiscardReason.REWARD_ERROR, problem, elapsed)
    return ScoreOutcome(result, elapsed_s=elapsed)
