"""Wordle plays scripted games through the same loop the orchestrator runs."""

import asyncio

import pytest

from refractor.envs import TrajectoryStep, get_environment, score_rollout
from refractor.envs.builtin.wordle import score_guess


def play(env, sample, guesses):
    async def main():
        state = env.create_initial_state(sample)
        messages = env.get_initial_prompt(sample)
        replies = []
        for text in guesses:
            completion = [{"role": "assistant", "content": text}]
            state.add_step(TrajectoryStep(prompt=messages, completion=completion))
            env_msgs = await env.env_response(messages + completion, state)
            replies.append(env_msgs[0]["content"])
            done, reason = env.is_done(state)
            if done:
                state.stop_reason = reason
                break
            messages = env.get_next_prompt_messages(state, env_msgs)
        return state, replies, await score_rollout(env, state, timeout_s=10)

    return asyncio.run(main())


def g(word):
    return f"<think>try {word}</think><guess>[{word}]</guess>"


@pytest.fixture(scope="module")
def env():
    return get_environment("wordle", num_samples=20)


def test_feedback_duplicates():
    assert score_guess("paper", "apple") == ["Y", "Y", "G", "Y", "X"]
    assert score_guess("lever", "hello") == ["Y", "G", "X", "X", "X"]
    assert score_guess("eerie", "there") == ["Y", "X", "Y", "X", "G"]


def test_initial_prompt_and_seeded_secrets(env):
    messages = env.get_initial_prompt(env.get_sample(0))
    assert messages[0]["role"] == "system" and "<guess>" in messages[0]["content"]
    assert messages[1]["content"].startswith(
        "You are Playing Wordle.\nA secret 5-letter word has been chosen."
    )
    again = get_environment("wordle", num_samples=20)
    assert [s.answer for s in env.samples] == [s.answer for s in again.samples]


def test_scripted_win(env):
    sample = env.get_sample(0).__class__(env.get_sample(0).prompt, answer="apple")
    state, replies, outcome = play(env, sample, [g("paper"), g("angle"), g("apple"), g("never")])
    assert replies[0] == "P A P E R\nY Y G Y X\nYou have 5 guesses left."
    assert replies[2] == "Congratulations! You guessed the word correctly!"
    assert state.stop_reason == "won" and state.num_turns == 3
    metrics = outcome.result.sample_metrics
    assert metrics["_reward_correct"] == 1.0 and metrics["_reward_partial"] == 0.0
    assert metrics["_reward_length"] == pytest.approx(1 / 3) and metrics["format_reward"] == 1.0
    assert outcome.result.total_reward == pytest.approx(1 + 1 / 3 + 0.2)
    assert outcome.result.golden_answers["_reward_correct"] == "apple"


def test_scripted_loss_after_six_guesses(env):
    sample = env.get_sample(0).__class__(env.get_sample(0).prompt, answer="zebra")
    words = ["house", "money", "plant", "stone", "crane", "bread"]
    state, replies, outcome = play(env, sample, [g(w) for w in words] + [g("zebra")])
    assert state.stop_reason == "game_over" and state.num_turns == 6
    assert "The secret word was: **zebra**" in replies[-1]
    metrics = outcome.result.sample_metrics
    last_feedback = score_guess("bread", "zebra")
    assert metrics["_reward_correct"] == 0.0 and metrics["_reward_length"] == 0.0
    assert metrics["_reward_partial"] == pytest.approx(
        0.2 * last_feedback.count("G") + 0.1 * last_feedback.count("Y")
    )


def test_invalid_moves_one_allowance_then_game_over(env):
    sample = env.get_sample(0).__class__(env.get_sample(0).prompt, answer="apple")
    state, replies, outcome = play(env, sample, ["I guess apple", g("house"), g("abc"), g("house")])
    assert replies[0].startswith(
        "You attempted an invalid move. Reason: You tried submitting a word in the wrong format."
    )
    assert replies[1].startswith("H O U S E")  # a valid move resets the error count
    assert "exactly 5 letters" in replies[2]
    assert "too many invalid moves" in replies[3] and "already guessed 'house'" in replies[3]
    assert state.stop_reason == "game_over"
    state, replies, _ = play(env, sample, [g("qwert")])
    assert replies[0].endswith(
        "Please resubmit a valid move and remember to follow the game rules to avoid penalties."
    )
    assert "'qwert' is not an English word." in replies[0]
    metrics = outcome.result.sample_metrics
    assert metrics["format_reward"] == pytest.approx((0.0 + 1 + 1 + 1) / 4)


def test_max_turns_stops_a_game_of_invalid_moves():
    env = get_environment("wordle", num_samples=2, max_turns=2)
    state, _, _ = play(env, env.get_sample(0), [g("house"), g("house"), g("money")])
    assert state.num_turns == 2 and state.stop_reason in ("max_turns_reached", "game_over")
