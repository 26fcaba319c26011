"""Rubric: weighted reward functions and metrics, failures recorded, blocking functions off the loop."""

import asyncio
import time

import pytest

from refractor.envs import Rubric, Sample


def test_rubric_weights_metrics_injection_sync_async_and_golden():
    seen = {}

    def exact(completion, answer):
        seen["exact"] = (completion, answer)
        return float(completion.strip() == answer), answer

    async def length(completion):
        return len(completion)

    def everything(**kwargs):
        seen["kwargs"] = sorted(kwargs)
        return 0.5

    rubric = Rubric().add_reward(exact, 2.0, range_min=0, range_max=1).add_reward(everything, 1.0)
    rubric.add_metric(length, name="chars")
    result = asyncio.run(rubric.score(completion="hi<|eos|>", sample=Sample("q", "hi"), eos_token="<|eos|>"))
    assert result.total_reward == pytest.approx(2.0 * 1.0 + 0.5)  # metric weight 0
    assert result.sample_metrics == {"exact": 1.0, "everything": 0.5, "chars": 2.0}
    assert result.golden_answers == {"exact": "hi", "everything": None, "chars": None}
    assert seen["exact"] == ("hi", "hi")  # eos stripped
    assert seen["kwargs"] == ["answer", "completion", "eos_token", "sample"]  # state None -> not passed
    assert rubric.metrics_ranges == {"exact": {"min": 0, "max": 1, "invert": False}}


def test_rubric_failing_function_scores_zero_and_is_recorded():
    def boom(completion):
        raise ValueError("bad")

    rubric = Rubric().add_reward(boom).add_reward(lambda completion: 1.0, name="ok")
    result = asyncio.run(rubric.score(completion="x"))
    assert result.total_reward == 1.0 and result.sample_metrics["boom"] == 0.0
    assert (
        result.info_turns[0]["info_key"] == "boom_error"
        and "ValueError: bad" in result.info_turns[0]["info_value"]
    )
    with pytest.raises(ValueError, match="already has"):
        rubric.add_reward(boom)


def test_sync_blocking_reward_runs_off_the_event_loop():
    def slow_sync(completion):
        time.sleep(0.5)  # a blocking reward
        return 1.0

    rubric = Rubric().add_reward(slow_sync)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        result = await rubric.score(completion="x")
        task.cancel()
        return result, ticks

    result, ticks = asyncio.run(main())
    assert result.total_reward == 1.0 and ticks >= 20  # the loop kept running while the reward blocked
