"""The quick start's task (environments/repeat_letter): its reward has no half-way plateau."""

import asyncio
from pathlib import Path

import pytest

from refractor.envs.registry import load_environment_class

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def env():
    cls = load_environment_class("repeat_letter", extra_paths=[ROOT / "environments"])
    return cls(letter="a")


@pytest.mark.parametrize("completion, expected", [
    ("aaaa", 1.0),
    (" a a a a", 1.0),  # the tokenizer's " a" token: counting spaces made this a 0.5 plateau
    ("a\na", 1.0),
    ("abab", 0.5),
    ("al la", 0.5),
    ("xyz", 0.0),
    ("", 0.0),
    ("   ", 0.0),
    ("aa<|im_end|>", 1.0),  # the end-of-sequence token is not part of the answer
])
def test_reward_is_the_fraction_of_visible_characters_that_are_the_letter(env, completion, expected):
    sample = env.load_dataset(num_samples=1)[0]
    result = asyncio.run(env.compute_reward(completion, sample, eos_token="<|im_end|>"))
    assert result.total_reward == pytest.approx(expected)
    assert result.sample_metrics["letter_fraction"] == pytest.approx(expected)


def test_a_bad_letter_is_named(env):
    with pytest.raises(ValueError, match="`letter` must be one character, got 'ab'"):
        type(env)(letter="ab")
