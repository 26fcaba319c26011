"""Output-quality filters: the same decisions for single- and multi-turn rollouts."""

from __future__ import annotations

import random
import string
import zlib

import pytest

from refractor.algorithms import (
    FilterFlags,
    FilterSettings,
    filter_metrics,
    is_gibberish,
    is_repetitive,
    output_filter_flags,
    sample_filter_flags,
    without_loss,
)
from refractor.config import load_config
from refractor.records import TrainSample

ALL_ON = FilterSettings(filter_overlong=True, filter_gibberish=True, filter_repetition=True)


def test_gibberish_rule():
    # threshold 100000, offset 2.0 -> flagged when id > 100000 and logprob < -13.5
    assert is_gibberish([100001], [-13.6], 100000, 2.0)
    assert not is_gibberish([100000], [-20.0], 100000, 2.0)  # id not above the threshold
    assert not is_gibberish([150000], [-13.4], 100000, 2.0)  # not unlikely enough
    assert not is_gibberish([150000], [-20.0], 100000, 2.0, loss_mask=[0])  # env token, not sampled


def test_repetition_rule():
    assert is_repetitive("ab" * 200, 10.0)
    rng = random.Random(0)
    prose = "".join(rng.choice(string.ascii_letters + " ") for _ in range(2000))
    assert not is_repetitive(prose, 10.0)
    assert not is_repetitive("a" * 99, 1.5)  # below 100 characters: never flagged
    long_tail = prose + "xyz" * 5000  # only the last 10 000 characters count
    tail = long_tail[-10_000:].encode()
    assert is_repetitive(long_tail, 10.0) == (len(tail) / len(zlib.compress(tail, 1)) > 10.0)


def test_disabled_filters_never_flag():
    flags = output_filter_flags([200000], [-50.0], "ab" * 200, True, FilterSettings())
    assert flags == FilterFlags() and not flags.any


def test_single_and_multi_turn_take_the_same_path():
    """A multi-turn sample (env tokens with mask 0 and logprob 0) is judged on its sampled tokens only."""
    single = TrainSample(
        input_ids=[1, 2, 3, 120000, 5],
        loss_mask=[0, 0, 1, 1, 1],
        advantage=1.0,
        rollout_logprobs=[0.0, 0.0, -0.1, -14.0, -0.2],
    )
    multi = TrainSample(
        input_ids=[1, 2, 3, 120000, 5, 130000, 7, 8],
        loss_mask=[0, 0, 1, 1, 1, 0, 0, 1],
        advantage=1.0,
        rollout_logprobs=[0.0, 0.0, -0.1, -14.0, -0.2, 0.0, 0.0, -0.3],
    )
    text = "answer " * 3
    for s in (single, multi):
        flags = sample_filter_flags(s, text, is_truncated=True, settings=ALL_ON)
        assert flags == FilterFlags(overlong=True, gibberish=True, repetition=False)
        masked = without_loss(s)
        assert masked.loss_mask == [0] * len(s.input_ids) and masked.input_ids == s.input_ids
        assert s.num_trainable_tokens > 0  # the original is untouched


def test_filter_metrics_fractions():
    flags = [
        FilterFlags(overlong=True),
        FilterFlags(gibberish=True, repetition=True),
        FilterFlags(),
        FilterFlags(),
    ]
    assert filter_metrics(flags, ALL_ON) == {
        "filter/overlong_frac": 0.25,
        "filter/gibberish_frac": 0.25,
        "filter/repetition_frac": 0.25,
    }
    assert filter_metrics(flags, FilterSettings(filter_gibberish=True)) == {"filter/gibberish_frac": 0.25}


def test_settings_from_config():
    cfg = load_config(
        None,
        {
            "environments": [{"name": "countdown"}],
            "filter_repetition": True,
            "repetition_compression_threshold": 4.0,
        },
    )
    s = FilterSettings.from_config(cfg)
    assert s.filter_repetition and s.repetition_compression_threshold == 4.0 and not s.filter_overlong
    assert s.gibberish_token_threshold == 100000


@pytest.mark.parametrize("offset", [0.5, 2.0, 5.0])
def test_gibberish_offset(offset):
    limit = -11.5 - offset
    assert is_gibberish([100001], [limit - 1e-6], 100000, offset)
    assert not is_gibberish([100001], [limit], 100000, offset)
