"""A tool-calling example: arithmetic problems solved with calculator tools (XML calls by default).

Reward ``correct`` (1 if the final ``<answer>`` equals the result, relative tolerance 1e-6); tool
metrics (``total_tool_calls``, ``tool_success_rate``, ``add_calls``...) are logged with weight 0.
Problems are generated from a seed, so the environment works offline.
"""

from __future__ import annotations

import math
import random
from typing import Any, ClassVar

from refractor.envs.parsers import extract_answer_tags, strip_think_tags
from refractor.envs.rewards import Rubric
from refractor.envs.tool_env import ToolEnvironment
from refractor.envs.tools import ToolCallFormat
from refractor.records import RewardResult, RolloutState, Sample

SYSTEM_PROMPT = (
    "You solve arithmetic problems exactly. Use the calculator tools for every operation, "
    "then give the final number inside <answer></answer> tags."
)


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def subtract(a: float, b: float) -> float:
    """Subtract b from a.

    Args:
        a: The minuend.
        b: The subtrahend.
    """
    return a - b


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def divide(a: float, b: float) -> float:
    """Divide a by b (b must not be zero).

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def _number(text: str | None) -> float | None:
    try:
        value = float(str(text).replace(",", "").strip())
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class CalculatorToolsEnvironment(ToolEnvironment):
    strict_kwargs = True
    dataset_is_generated: ClassVar[bool] = True
    reward_min = 0.0
    reward_max = 1.0

    def __init__(
        self,
        system_prompt: str | None = SYSTEM_PROMPT,
        max_turns: int = 6,
        tool_call_format: ToolCallFormat = "xml",
        num_problems: int = 1000,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            tools=[add, subtract, multiply, divide],
            max_turns=max_turns,
            tool_call_format=tool_call_format,
            system_prompt=system_prompt,
            **kwargs,
        )
        self.num_problems = num_problems
        self.seed = seed
        self.rubric = Rubric().add_reward(self.correct, range_min=0.0, range_max=1.0)

    metrics_ranges: ClassVar[dict[str, dict[str, Any]]] = {
        "correct": {"min": 0.0, "max": 1.0, "invert": False},
        "tool_success_rate": {"min": 0.0, "max": 1.0, "invert": False},
    }

    def load_dataset(self, num_samples: int = -1, **kwargs: Any) -> list[Sample]:
        rng = random.Random(self.seed)
        samples = []
        for _ in range(num_samples if num_samples > 0 else self.num_problems):
            a = rng.randint(2, 999)
            b = rng.randint(2, 99)
            c = rng.randint(2, 99)
            op1 = rng.choice("+-*")
            op2 = rng.choice("+-*/")
            expression = f"({a} {op1} {b}) {op2} {c}"
            value = {"+": a + b, "-": a - b, "*": a * b}[op1]
            value = {"+": value + c, "-": value - c, "*": value * c, "/": value / c}[op2]
            samples.append(
                Sample(
                    prompt=f"Compute {expression}.", answer=repr(value), metadata={"expression": expression}
                )
            )
        self._samples = samples
        return samples

    def correct(self, state: RolloutState, sample: Sample) -> tuple[float, str]:
        final = strip_think_tags(state.last_completion_text)
        predicted = _number(extract_answer_tags(final))
        expected = float(sample.answer)
        ok = predicted is not None and math.isclose(predicted, expected, rel_tol=1e-6, abs_tol=1e-9)
        return (1.0 if ok else 0.0), sample.answer

    async def compute_reward(self, state: RolloutState, eos_token: str = "") -> RewardResult:
        return await self.rubric.score(
            state=state, eos_token=eos_token, extra_sample_metrics=self.get_tool_metrics(state)
        )
