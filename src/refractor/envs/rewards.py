"""Composable rewards: a ``Rubric`` is a weighted list of functions.

Each function is called with only the keyword arguments it declares, chosen from ``completion``,
``sample``, ``state``, ``eos_token`` and ``answer`` (``sample.answer``); a function with
``**kwargs`` gets all of them that are not None. Functions may be sync (run in the reward thread
pool, off the event loop) or async, and return ``score`` or ``(score, golden_answer)``.
``total_reward = sum(weight * score)``; every score is logged in ``sample_metrics[name]``.
Metrics (``add_metric``) have weight 0: logged, not rewarded.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from refractor.envs.base import strip_eos
from refractor.envs.runners import call_maybe_async
from refractor.records import RewardResult, RolloutState, Sample, info_turn

logger = logging.getLogger(__name__)

INJECTABLE = ("completion", "sample", "state", "eos_token", "answer")


@dataclass
class RewardFunction:
    func: Callable[..., Any]
    weight: float
    name: str
    golden_answer: str | None = None
    range_min: float | None = None
    range_max: float | None = None
    invert: bool = False

    def select_kwargs(self, available: dict[str, Any]) -> dict[str, Any]:
        params = inspect.signature(self.func).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return {k: v for k, v in available.items() if v is not None}
        return {k: v for k, v in available.items() if k in params}


class Rubric:
    """Weighted reward functions plus zero-weight metrics."""

    def __init__(self) -> None:
        self.functions: list[RewardFunction] = []

    def add_reward(
        self,
        func: Callable[..., Any],
        weight: float = 1.0,
        *,
        name: str | None = None,
        golden_answer: str | None = None,
        range_min: float | None = None,
        range_max: float | None = None,
        invert: bool = False,
    ) -> Rubric:
        fn_name = name or getattr(func, "__name__", None) or type(func).__name__
        if any(f.name == fn_name for f in self.functions):
            raise ValueError(
                f"Rubric already has a function named {fn_name!r}; pass name=... to disambiguate"
            )
        self.functions.append(
            RewardFunction(func, float(weight), fn_name, golden_answer, range_min, range_max, invert)
        )
        return self

    def add_metric(
        self,
        func: Callable[..., Any],
        *,
        name: str | None = None,
        golden_answer: str | None = None,
        range_min: float | None = None,
        range_max: float | None = None,
        invert: bool = False,
    ) -> Rubric:
        return self.add_reward(
            func,
            0.0,
            name=name,
            golden_answer=golden_answer,
            range_min=range_min,
            range_max=range_max,
            invert=invert,
        )

    @property
    def metrics_ranges(self) -> dict[str, dict[str, Any]]:
        return {
            f.name: {"min": f.range_min, "max": f.range_max, "invert": f.invert}
            for f in self.functions
            if f.range_min is not None or f.range_max is not None
        }

    async def score(
        self,
        *,
        completion: str | None = None,
        sample: Sample | None = None,
        state: RolloutState | None = None,
        eos_token: str = "",
        extra_sample_metrics: dict[str, float] | None = None,
        extra_golden_answers: dict[str, str | None] | None = None,
        extra_info_turns: list[dict[str, Any]] | None = None,
        extra_sample_tags: dict[str, str] | None = None,
    ) -> RewardResult:
        if completion is None and state is not None:
            completion = state.completion_text
        if completion is not None:
            completion = strip_eos(completion, eos_token)
        if sample is None and state is not None:
            sample = state.sample
        available = {
            "completion": completion,
            "sample": sample,
            "state": state,
            "eos_token": eos_token,
            "answer": sample.answer if sample is not None else None,
        }
        total = 0.0
        metrics: dict[str, float] = {}
        golden: dict[str, str | None] = {}
        info_turns: list[dict[str, Any]] = []
        for fn in self.functions:
            score, answer = await self._call(fn, available, info_turns)
            metrics[fn.name] = score
            total += fn.weight * score
            golden[fn.name] = answer if answer is not None else fn.golden_answer
        metrics.update(extra_sample_metrics or {})
        golden.update(extra_golden_answers or {})
        return RewardResult(
            total_reward=total,
            sample_metrics=metrics,
            golden_answers=golden,
            info_turns=info_turns + list(extra_info_turns or []),
            sample_tags=dict(extra_sample_tags or {}),
        )

    async def _call(
        self, fn: RewardFunction, available: dict[str, Any], info_turns: list[dict[str, Any]]
    ) -> tuple[float, str | None]:
        try:
            value = await call_maybe_async(fn.func, **fn.select_kwargs(available))
            answer = None
            if isinstance(value, tuple):
                value, answer = value
            return float(value), (None if answer is None else str(answer))
        except Exception as err:  # a failing function scores 0 (recorded, not raised)
            logger.warning("reward function %s failed: %s: %s", fn.name, type(err).__name__, err)
            info_turns.append(info_turn(f"{fn.name}_error", f"{type(err).__name__}: {err}"[:4000], "stderr"))
            return 0.0, None
