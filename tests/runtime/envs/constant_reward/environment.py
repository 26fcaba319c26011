"""A user environment whose reward is the same for every completion: no group ever has an advantage."""

from refractor.envs.base import SingleTurnEnvironment
from refractor.records import RewardResult, Sample


class ConstantRewardEnvironment(SingleTurnEnvironment):
    def load_dataset(self, num_samples: int = -1, **kwargs) -> list[Sample]:
        self._samples = [Sample(prompt=f"Say something ({i}).", answer=str(i)) for i in range(16)]
        return self._samples

    async def compute_reward(self, completion: str, sample: Sample, eos_token: str = "") -> RewardResult:
        return RewardResult(total_reward=1.0)
