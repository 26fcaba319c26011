"""A toy task a tiny random model learns on CPU in a few dozen GRPO steps (the quick start's task).

It is written only against the public environment API, exactly like a user's environment, and is
found because it sits in ./environments/<name>/environment.py.

Reward: the fraction of the completion's non-whitespace characters that are the requested letter. A
random model scores ~0.05; a model that has learned to repeat the letter scores 1.0, with or without
spaces between the letters. (Counting spaces made " a a a" a 0.5 plateau: the tokenizer has a " a"
token, and a run that collapsed onto it had no reward variance left to climb out.)
"""

from refractor.envs.base import SingleTurnEnvironment
from refractor.envs.records import RewardResult, Sample


class RepeatLetterEnvironment(SingleTurnEnvironment):
    reward_min, reward_max = 0.0, 1.0

    def __init__(self, letter: str = "a", num_prompts: int = 32, **kwargs):
        super().__init__(**kwargs)
        if len(letter) != 1:
            raise ValueError(f"repeat_letter: `letter` must be one character, got {letter!r}")
        self.letter, self.num_prompts = letter, num_prompts

    def load_dataset(self, num_samples: int = -1, **kwargs) -> list[Sample]:
        n = num_samples if num_samples > 0 else self.num_prompts
        self._samples = [Sample(prompt=f"Write the letter {self.letter} as many times as you can. (#{i})",
                                answer=self.letter) for i in range(n)]
        return self._samples

    async def compute_reward(self, completion: str, sample: Sample, eos_token: str = "") -> RewardResult:
        text = completion[: -len(eos_token)] if eos_token and completion.endswith(eos_token) else completion
        visible = [ch for ch in text if not ch.isspace()]
        fraction = sum(ch == sample.answer for ch in visible) / max(len(visible), 1)
        return RewardResult(total_reward=fraction, sample_metrics={"letter_fraction": fraction},
                            golden_answers={"letter": sample.answer})
