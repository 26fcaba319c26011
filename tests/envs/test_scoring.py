"""score_rollout: a result, or a typed discard reason for exceptions, timeouts and invalid results."""

import asyncio
import time

from refractor.envs import RewardResult, Sample, SingleTurnEnvironment, score_rollout
from refractor.envs.testing import finished_state
from refractor.records import DiscardReason


class EchoEnv(SingleTurnEnvironment):
    def __init__(self, reward_fn=None, **kwargs):
        super().__init__(**kwargs)
        self.reward_fn = reward_fn

    def load_dataset(self, num_samples=-1, **kwargs):
        self._samples = [Sample("say hi", answer="hi")]
        return self._samples

    async def compute_reward(self, completion, sample, eos_token=""):
        return await self.reward_fn(completion, sample)


def _outcome(env, completion="hi", timeout_s=5.0):
    env.load_dataset()
    return asyncio.run(
        score_rollout(env, finished_state(env, env.get_sample(0), completion), timeout_s=timeout_s)
    )


def test_score_rollout_success_and_prompt_shape():
    async def reward(completion, sample):
        return RewardResult(total_reward=float(completion == sample.answer), sample_metrics={"m": True})

    env = EchoEnv(reward, system_prompt="S", instruction_prompt="I")
    assert env.get_initial_prompt(Sample("q")) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "I\n\nq"},
    ]
    outcome = _outcome(env)
    assert outcome.ok and outcome.result.total_reward == 1.0 and outcome.result.sample_metrics == {"m": 1.0}
    state = finished_state(env, env.get_sample(0), "hi")
    assert env.is_done(state) == (True, "completed")


def test_score_rollout_records_exceptions_timeouts_and_invalid_results():
    async def raises(completion, sample):
        raise RuntimeError("reward exploded")

    async def hangs(completion, sample):
        await asyncio.sleep(60)

    async def nan(completion, sample):
        return RewardResult(total_reward=float("nan"))

    async def wrong_type(completion, sample):
        return 1.0

    failure = _outcome(EchoEnv(raises))
    assert not failure.ok and failure.reason == DiscardReason.REWARD_ERROR
    assert failure.detail.startswith("reward_error: RuntimeError: reward exploded")
    start = time.perf_counter()
    failure = _outcome(EchoEnv(hangs), timeout_s=0.2)
    assert failure.reason == DiscardReason.REWARD_TIMEOUT and failure.detail.startswith("reward_timeout")
    assert time.perf_counter() - start < 5
    for invalid in (nan, wrong_type):  # an invalid result is discarded as a reward error
        outcome = _outcome(EchoEnv(invalid))
        assert outcome.reason == DiscardReason.REWARD_ERROR and outcome.detail.startswith("invalid_reward")
    zero = failure.reward_or_zero()
    assert zero.total_reward == 0.0 and zero.sample_metrics == {"reward_failed": 1.0}
    assert "reward_timeout" in zero.info_turns[0]["info_value"]
