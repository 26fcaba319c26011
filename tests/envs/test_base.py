"""Environment base classes written against as a user would: the turn protocol, plain subclasses,
prompt rendering."""

import asyncio

from refractor.envs import (
    Environment,
    MultiTurnEnvironment,
    RewardResult,
    Sample,
    TrajectoryStep,
    score_rollout,
)
from refractor.envs.testing import finished_state


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
                state.is_completed = True
                state.stop_reason = reason
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
    outcome = asyncio.run(score_rollout(env, finished_state(env, env.get_sample(0), "a"), timeout_s=5.0))
    assert outcome.result.total_reward == 1.0
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
