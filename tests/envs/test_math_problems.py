"""Built-in math environments: fixture datasets, boxed-answer rewards, concurrent scoring."""

import asyncio
import time

import pytest

from refractor.envs import get_environment, score_rollout
from refractor.envs.data import fixture_path
from refractor.envs.testing import finished_state


def score(env, sample, completion, timeout_s=60):
    outcome = asyncio.run(score_rollout(env, finished_state(env, sample, completion), timeout_s=timeout_s))
    assert outcome.ok, outcome.detail
    return outcome.result


@pytest.mark.parametrize(("name", "size"), [("hendrycks_math", 3), ("dapo_math", 2), ("deepscaler", 3)])
def test_math_fixture_rows_become_samples(name, size):
    env = get_environment(name, dataset_name=str(fixture_path(name)))
    assert len(env) == size and env.name == name
    user = env.get_initial_prompt(env.get_sample(0))[-1]["content"]
    assert user.startswith("Show your work and put your final answer within \\boxed{}.\n\n")


def test_math_rewards_correct_wrong_malformed_adversarial():
    env = get_environment("deepscaler", dataset_name=str(fixture_path("deepscaler")))
    frac = env.get_sample(2)  # 3/4
    cases = {
        "<think>6/8 = 0.75</think> The answer is \\boxed{\\frac{3}{4}}": 1.0,
        "<think>hmm \\boxed{1}</think> so \\boxed{0.75}": 1.0,  # equivalent form, after think
        "\\boxed{\\frac{3}{4}} wait no \\boxed{\\frac{2}{3}}": 0.0,  # the last box counts
        "<think>\\boxed{\\frac{3}{4}}</think> I am not sure": 0.0,  # boxed only inside think
        "\\boxed{\\frac{3}{4}": 0.0,  # unbalanced
        "\\boxed{" + "9" * 600 + "}": 0.0,  # over-long answer
        "\\boxed{" + "(" * 300 + "1" + ")" * 300 + "}": 0.0,
    }
    for completion, expected in cases.items():
        result = score(env, frac, completion)
        assert result.sample_metrics == {"correct": expected}, completion[:80]
        assert result.golden_answers == {"correct": "\\frac{3}{4}"}


def test_math_scoring_of_many_rollouts_runs_concurrently():
    env = get_environment("hendrycks_math", dataset_name=str(fixture_path("hendrycks_math")))
    sample = env.get_sample(1)  # 7

    async def main():
        states = [finished_state(env, sample, f"\\boxed{{{7 if i % 2 else 8}}}") for i in range(16)]
        return await asyncio.gather(*(score_rollout(env, s, timeout_s=60) for s in states))

    start = time.perf_counter()
    outcomes = asyncio.run(main())
    assert [o.result.total_reward for o in outcomes] == [float(i % 2) for i in range(16)]
    assert time.perf_counter() - start < 30
