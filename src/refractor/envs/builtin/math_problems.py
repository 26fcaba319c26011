"""Math environments with a boxed final answer checked by math-verify:
``hendrycks_math``, ``dapo_math``, ``deepscaler``. They differ only in how a dataset row becomes
(question, answer). Reward: ``correct`` in {0, 1}: strip think -> last ``\\boxed{}`` -> verify.
Verification runs in a worker process (hard timeout), never on the event loop.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from refractor.envs.base import SingleTurnEnvironment
from refractor.envs.data import load_rows, take
from refractor.envs.parsers import extract_boxed_answer, strip_think_tags, verify_math_answer_async
from refractor.envs.rewards import Rubric
from refractor.records import RewardResult, Sample

REQUIRED_PACKAGES = ["math-verify"]
SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user "
    "with the answer."
)
INSTRUCTION_PROMPT = "Show your work and put your final answer within \\boxed{}."


class MathEnvironment(SingleTurnEnvironment):
    """Shared logic; subclasses set the dataset defaults and ``parse_row``."""

    strict_kwargs = True
    reward_min = 0.0
    reward_max = 1.0
    metrics_ranges: ClassVar[dict[str, dict[str, Any]]] = {
        "correct": {"min": 0.0, "max": 1.0, "invert": False}
    }
    default_dataset: ClassVar[str] = ""
    default_subset: ClassVar[str | None] = None

    def __init__(
        self,
        system_prompt: str | None = SYSTEM_PROMPT,
        instruction_prompt: str | None = INSTRUCTION_PROMPT,
        dataset_name: str | None = None,
        dataset_subset: str | None = None,
        dataset_split: str = "train",
        verify_timeout_s: float = 5.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(system_prompt=system_prompt, instruction_prompt=instruction_prompt, **kwargs)
        self.dataset_name = dataset_name or self.default_dataset
        self.dataset_subset = dataset_subset if dataset_subset is not None else self.default_subset
        self.dataset_split = dataset_split
        self.verify_timeout_s = verify_timeout_s
        self.rubric = Rubric().add_reward(self.correct, range_min=0.0, range_max=1.0)

    def parse_row(self, row: dict[str, Any]) -> tuple[str, str] | None:
        """(question, answer) of a dataset row, or None to skip the row."""
        raise NotImplementedError

    def load_dataset(self, num_samples: int = -1, **kwargs: Any) -> list[Sample]:
        rows = load_rows(self.dataset_name, self.dataset_subset, self.dataset_split)
        samples = []
        for row in rows:
            parsed = self.parse_row(row)
            if parsed is not None:
                samples.append(Sample(prompt=parsed[0], answer=parsed[1]))
        self._samples = take(samples, num_samples)
        return self._samples

    async def correct(self, completion: str, answer: str) -> tuple[float, str]:
        predicted = extract_boxed_answer(strip_think_tags(completion))
        ok = await verify_math_answer_async(predicted, answer, timeout_s=self.verify_timeout_s)
        return (1.0 if ok else 0.0), answer

    async def compute_reward(self, completion: str, sample: Sample, eos_token: str = "") -> RewardResult:
        return await self.rubric.score(completion=completion, sample=sample, eos_token=eos_token)


class HendrycksMathEnvironment(MathEnvironment):
    """Rows with a string ``prompt`` and ``verification_info`` = JSON ``{"ground_truth": ...}``."""

    default_dataset = "justus27/math-hendrycks-genesys-format"
    default_subset = "default"

    def parse_row(self, row: dict[str, Any]) -> tuple[str, str] | None:
        info = row.get("verification_info")
        if not isinstance(row.get("prompt"), str) or info is None:
            return None
        try:
            truth = (json.loads(info) if isinstance(info, str) else info).get("ground_truth")
        except (json.JSONDecodeError, AttributeError):
            return None
        return (row["prompt"], str(truth)) if truth is not None else None


class DapoMathEnvironment(MathEnvironment):
    """Rows with ``prompt = [{"content": question}, ...]`` and ``reward_model.ground_truth``."""

    default_dataset = "BytedTsinghua-SIA/DAPO-Math-17k"

    def parse_row(self, row: dict[str, Any]) -> tuple[str, str] | None:
        try:
            return str(row["prompt"][0]["content"]), str(row["reward_model"]["ground_truth"])
        except (KeyError, IndexError, TypeError):
            return None


class DeepScalerEnvironment(MathEnvironment):
    """Rows with ``problem`` and ``answer``."""

    default_dataset = "agentica-org/DeepScaleR-Preview-Dataset"

    def parse_row(self, row: dict[str, Any]) -> tuple[str, str] | None:
        if row.get("problem") is None or row.get("answer") is None:
            return None
        return str(row["problem"]), str(row["answer"])
