"""An eval with known pass rates: prompt p gets exactly ``p % (K + 1)`` correct completions out of K,
whatever the model writes (the i-th completion scored for a prompt is correct when ``i % K < c``)."""

from collections import Counter

from refractor.envs.base import SingleTurnEnvironment
from refractor.records import EvalMetricsResult, RewardResult, Sample


class FixedPassRateEnvironment(SingleTurnEnvironment):
    def __init__(self, completions_per_prompt: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.completions_per_prompt = completions_per_prompt
        self.scored: Counter[int] = Counter()

    def load_dataset(self, num_samples: int = -1, **kwargs) -> list[Sample]:
        self._samples = [Sample(prompt=f"Say anything ({p}).", answer=str(p)) for p in range(8)]
        return self._samples

    async def compute_reward(self, completion: str, sample: Sample, eos_token: str = "") -> RewardResult:
        return RewardResult(total_reward=0.0)

    async def compute_eval_metrics(
        self, completion: str, sample: Sample, eos_token: str = ""
    ) -> EvalMetricsResult:
        k = self.completions_per_prompt
        p = int(sample.answer)
        i = self.scored[p]
        self.scored[p] += 1
        return EvalMetricsResult(metrics={"correct": float(i % k < p % (k + 1))})
