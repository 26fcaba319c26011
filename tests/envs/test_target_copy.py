"""Built-in target_copy environment: a dense, bounded copy reward."""

import asyncio

import pytest

from refractor.envs import get_environment, score_rollout
from refractor.envs.builtin.target_copy import match_fraction
from refractor.envs.testing import finished_state


def score(env, sample, completion, timeout_s=60):
    outcome = asyncio.run(score_rollout(env, finished_state(env, sample, completion), timeout_s=timeout_s))
    assert outcome.ok, outcome.detail
    return outcome.result


def test_target_copy_reward_is_dense_and_bounded():
    assert match_fraction("aaaaaaaa", "aaaaaaaa") == 1.0
    assert match_fraction("aaaabbbb", "aaaaaaaa") == 0.5
    assert match_fraction("aaaaaaaaaaaaaaaa", "aaaaaaaa") == 0.5  # extra characters cost
    assert match_fraction("", "aaaaaaaa") == 0.0
    env = get_environment("target_copy", num_prompts=4)
    sample = env.get_sample(0)
    assert "aaaaaaaa" in env.get_initial_prompt(sample)[-1]["content"]
    result = score(env, sample, "aaaaaaab<|endoftext|>")
    assert result.total_reward == pytest.approx(7 / 8)
    assert result.sample_metrics == {"match_fraction": 7 / 8, "exact_match": 0.0}
    rand = get_environment(
        "target_copy", random_targets=True, alphabet="xyz", target_length=5, num_prompts=10
    )
    targets = {s.answer for s in rand.samples}
    assert len(targets) > 1 and all(len(t) == 5 and set(t) <= set("xyz") for t in targets)
