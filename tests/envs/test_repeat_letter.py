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


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("aaaa", 1.0),
        (" a a a a", 1.0),  # the tokenizer's " a" token
        ("a\naa", 1.0),
        ("an an an", 0.0),  # a two-character token with the letter in it earns nothing (no 0.5 plateau)
        ("al la", 0.0),
        ("a an", 1 / 3),
        ("aa bcd", 0.4),
        ("xyz", 0.0),
        ("", 0.0),
        ("   ", 0.0),
        ("aa<|im_end|>", 1.0),  # the end-of-sequence token is not part of the answer
    ],
)
def test_reward_is_the_share_of_characters_in_words_of_only_the_letter(env, completion, expected):
    sample = env.load_dataset(num_samples=1)[0]
    result = asyncio.run(env.compute_reward(completion, sample, eos_token="<|im_end|>"))
    assert result.total_reward == pytest.approx(expected)
    assert result.sample_metrics["letter_fraction"] == pytest.approx(expected)


def test_a_bad_letter_is_named(env):
    with pytest.raises(ValueError, match="`letter` must be one character, got 'ab'"):
        type(env)(letter="ab")
