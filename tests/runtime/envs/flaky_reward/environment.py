"""A user environment whose reward function raises on some samples (failure-path test)."""

from refractor.envs.base import SingleTurnEnvironment
from refractor.records import RewardResult, Sample


class FlakyRewardEnvironment(SingleTurnEnvironment):
    def load_dataset(self, num_samples: int = -1, **kwargs) -> list[Sample]:
        self._samples = [Sample(prompt=f"Say something ({i}).", answer=str(i)) for i in range(16)]
        return self._samples

    async def compute_reward(self, completion: str, sample: Sample, eos_token: str = "") -> RewardResult:
        if sample.answer in ("0", "1"):  # two of the sixteen prompts
            raise RuntimeError("the judge is down")
        return RewardResult(total_reward=(len(completion) % 7) / 7.0)
