"""The environment API written against as a user would: rubric, scoring, turn protocol."""

import asyncio
import time

import pytest

from refractor.envs import (
    Environment,
    MultiTurnEnvironment,
    RewardResult,
    Rubric,
    Sample,
    SingleTurnEnvironment,
    TrajectoryStep,
    score_rollout,
)
from refractor.envs.testing import finished_state


class EchoEnv(SingleTurnEnvironment):
    def __init__(self, reward_fn=None, **kwargs):
        super().__init__(**kwargs)
        self.reward_fn = reward_fn

    def load_dataset(self, num_samples=-1, **kwargs):
        self._samples = [Sample("say hi", answer="hi")]
        return self._samples

    async def compute_reward(self, completion, sample, eos_token=""):
        return await self.reward_fn(completion, sample)


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
    assert not failure.ok and failure.failure_reason.startswith("reward_error: RuntimeError: reward exploded")
    start = time.perf_counter()
    failure = _outcome(EchoEnv(hangs), timeout_s=0.2)
    assert failure.failure_reason.startswith("reward_timeout") and time.perf_counter() - start < 5
    assert _outcome(EchoEnv(nan)).failure_reason.startswith("invalid_reward")
    assert _outcome(EchoEnv(wrong_type)).failure_reason.startswith("invalid_reward")
    zero = failure.reward_or_zero()
    assert zero.total_reward == 0.0 and zero.sample_metrics == {"reward_failed": 1.0}
    assert "reward_timeout" in zero.info_turns[0]["info_value"]


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


class CounterEnv(MultiTurnEnvironment):
    """Ends when the model says 'stop'; the env answers with the turn number."""

    def load_dataset(self, num_samples=-1, **kwargs):
        self._samples = [Sample([{"role": "user", "content": "count"}])]
        return self._samples

    async def env_response(self, messages, state):
        state.custom["said_stop"] = "stop" in messages[-1]["content"]
        return [{"role": "user", "content": f"turn {state.num_turns}", "turn_type": "feedback"}]

    def is_done(self, state):
        if state.custom.get("said_stop"):
            return True, "stopped"
        return super().is_done(state)

    async def compute_reward(self, state, eos_token=""):
        return RewardResult(total_reward=float(state.num_turns))


def drive(env, sample, replies):
    """The orchestrator loop from the refractor.envs docstring, with scripted model replies."""

    async def main():
        state = env.create_initial_state(sample)
        messages = env.get_initial_prompt(sample)
        for text in replies:
            completion = [{"role": "assistant", "content": text}]
            state.add_step(TrajectoryStep(prompt=messages, completion=completion))
            env_msgs = await env.env_response(messages + completion, state)
            done, reason = env.is_done(state)
            if done:
                state.is_completed, state.stop_reason = True, reason
                break
            messages = env.get_next_prompt_messages(state, env_msgs)
        return state, messages, await score_rollout(env, state, timeout_s=5)

    return asyncio.run(main())


def test_multi_turn_protocol_messages_and_termination():
    env = CounterEnv(max_turns=5, system_prompt="sys")
    state, messages, outcome = drive(env, env.samples[0], ["a", "b", "stop", "never"])
    assert state.stop_reason == "stopped" and state.num_turns == 3 and outcome.result.total_reward == 3.0
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[-1]["content"] == "turn 2" and state.completion_text == "a\nb\nstop"
    state, _, _ = drive(CounterEnv(max_turns=2), env.samples[0], ["a", "b", "c"])
    assert state.stop_reason == "max_turns_reached" and state.num_turns == 2


def test_plain_environment_subclass_is_single_turn_and_sync_reward_allowed():
    class Minimal(Environment):
        def load_dataset(self, num_samples=-1, **kwargs):
            self._samples = [Sample("q", "a")]
            return self._samples

        def compute_reward(self, completion, sample):  # sync, no eos_token parameter
            return RewardResult(total_reward=float(completion == sample.answer))

    env = Minimal(custom_option=3)
    assert env.custom_option == 3 and not env.is_multi_turn and len(env) == 1
    assert _outcome(env, "a").result.total_reward == 1.0
    assert asyncio.run(env.score_eval(finished_state(env, env.get_sample(0), "a"))).metrics == {}


def test_render_prompt_with_a_real_chat_template(tiny_qwen2_path):
    from transformers import AutoTokenizer

    from refractor.envs import get_environment

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_path)
    env = get_environment(
        "countdown", dataset_name="procedural", procedural_num_samples=2, add_thinking_prefix=True
    )
    text = env.format_prompt("Q?", tokenizer)
    assert text.endswith("<|im_start|>assistant\n<think>")  # continued, no end-of-turn after the prefix
    assert "<|im_start|>system\n" in text and "Q?" in text
    plain = env.render_prompt([{"role": "user", "content": "hi", "turn_type": "x"}], tokenizer)
    assert plain.endswith("<|im_start|>assistant\n") and "turn_type" not in plain


def test_process_runner_timeouts_kill_only_the_runaway_call():
    from refractor.envs.scoring import ProcessRunner

    runner = ProcessRunner(processes=2)

    async def main():
        slow = asyncio.ensure_future(runner.run(time.sleep, 30, timeout_s=0.5))
        fast = await runner.run(pow, 2, 10, timeout_s=20)
        with pytest.raises(TimeoutError, match="sleep took longer"):
            await slow
        with pytest.raises(ValueError):
            await runner.run(int, "not a number", timeout_s=20)
        return fast, await runner.run(pow, 3, 3, timeout_s=20)

    try:
        assert asyncio.run(main()) == (1024, 27)
    finally:
        runner.close()
