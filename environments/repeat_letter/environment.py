"""A toy task a tiny random model learns on CPU in a few dozen GRPO steps (the quick start's task).

It is written only against the public environment API, exactly like a user's environment, and is
found because it sits in ./environments/<name>/environment.py.

Reward: the share of the completion's non-whitespace characters that sit in words made only of the
requested letter ("aaa a" scores 1.0, "a an" 1/3, "an an" 0). A model that has learned to repeat the
letter scores 1.0, with or without spaces. Letters inside other words earn nothing on purpose: with
per-character credit, a policy collapsed onto a two-character token such as "an" or " a" (the tiny
tokenizer has both) would score exactly 0.5 on every sample, leaving GRPO no reward variance to
climb out with.
"""

from refractor.envs.base import SingleTurnEnvironment
from refractor.records import RewardResult, Sample


class RepeatLetterEnvironment(SingleTurnEnvironment):
    reward_min = 0.0
    reward_max = 1.0

    def __init__(self, letter: str = "a", num_prompts: int = 32, **kwargs):
        super().__init__(**kwargs)
        if len(letter) != 1:
            raise ValueError(f"repeat_letter: `letter` must be one character, got {letter!r}")
        self.letter = letter
        self.num_prompts = num_prompts

    def load_dataset(self, num_samples: int = -1, **kwargs) -> list[Sample]:
        n = num_samples if num_samples > 0 else self.num_prompts
        self._samples = [
            Sample(
                prompt=f"Write the letter {self.letter} as many times as you can. (#{i})", answer=self.letter
            )
            for i in range(n)
        ]
        return self._samples

    async def compute_reward(self, completion: str, sample: Sample, eos_token: str = "") -> RewardResult:
        text = completion[: -len(eos_token)] if eos_token and completion.endswith(eos_token) else completion
        words = text.split()
        visible = sum(len(word) for word in words)
        fraction = sum(len(word) for word in words if set(word) == {sample.answer}) / max(visible, 1)
        return RewardResult(
            total_reward=fraction,
            sample_metrics={"letter_fraction": fraction},
            golden_answers={"letter": sample.answer},
        )
