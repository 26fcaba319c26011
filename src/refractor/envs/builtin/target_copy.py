"""A synthetic single-turn task that a tiny random model learns in a few dozen CPU GRPO steps.

The prompt shows a target string; the reward is dense: ``match_fraction`` = number of positions
where the completion's character equals the target's, divided by the longer of the two lengths
(so both wrong characters and extra characters cost). ``exact_match`` is logged with weight 0.
By default every sample has the same target (``target="aaaaaaaa"``), the easiest signal for a
learning test; ``random_targets=True`` draws per-sample targets from ``alphabet`` instead.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

from refractor.envs.base import SingleTurnEnvironment
from refractor.envs.rewards import Rubric
from refractor.records import RewardResult, Sample


def match_fraction(completion: str, target: str) -> float:
    text = completion.strip()
    if not target and not text:
        return 1.0
    matches = sum(a == b for a, b in zip(text, target, strict=False))
    return matches / max(len(text), len(target))


class TargetCopyEnvironment(SingleTurnEnvironment):
    strict_kwargs = True
    dataset_is_generated: ClassVar[bool] = True
    reward_min = 0.0
    reward_max = 1.0
    metrics_ranges: ClassVar[dict[str, dict[str, Any]]] = {
        "match_fraction": {"min": 0.0, "max": 1.0, "invert": False},
        "exact_match": {"min": 0.0, "max": 1.0, "invert": False},
    }

    def __init__(
        self,
        system_prompt: str | None = None,
        instruction_prompt: str | None = "Copy the text exactly.",
        target: str = "aaaaaaaa",
        random_targets: bool = False,
        alphabet: str = "ab",
        target_length: int = 8,
        num_prompts: int = 64,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(system_prompt=system_prompt, instruction_prompt=instruction_prompt, **kwargs)
        if random_targets and (not alphabet or target_length < 1):
            raise ValueError("target_copy: random_targets needs a non-empty alphabet and target_length >= 1")
        self.target = target
        self.random_targets = random_targets
        self.alphabet = alphabet
        self.target_length = target_length
        self.num_prompts = num_prompts
        self.seed = seed
        self.rubric = Rubric().add_reward(self.match_fraction).add_metric(self.exact_match)

    def load_dataset(self, num_samples: int = -1, **kwargs: Any) -> list[Sample]:
        rng = random.Random(self.seed)
        samples = []
        for _ in range(num_samples if num_samples > 0 else self.num_prompts):
            target = (
                "".join(rng.choice(self.alphabet) for _ in range(self.target_length))
                if self.random_targets
                else self.target
            )
            samples.append(Sample(prompt=target, answer=target))
        self._samples = samples
        return samples

    def match_fraction(self, completion: str, answer: str) -> tuple[float, str]:
        return match_fraction(completion, answer), answer

    def exact_match(self, completion: str, answer: str) -> float:
        return float(completion.strip() == answer)

    async def compute_reward(self, completion: str, sample: Sample, eos_token: str = "") -> RewardResult:
        return await self.rubric.score(completion=completion, sample=sample, eos_token=eos_token)
