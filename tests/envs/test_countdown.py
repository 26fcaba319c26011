import asyncio
import random

import pytest

from refractor.envs import get_environment, score_rollout
from refractor.envs.builtin.countdown import equation_is_correct, evaluate_arithmetic, generate_problem
from refractor.envs.data import fixture_path
from refractor.envs.testing import finished_state


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def env():
    env = get_environment("countdown", dataset_name=str(fixture_path("countdown")))
    env.load_dataset()
    return env


def score(env, sample, completion):
    outcome = run(score_rollout(env, finished_state(env, sample, completion), timeout_s=30))
    assert outcome.ok, outcome.detail
    return outcome.result


def test_fixture_loads_and_prompt_mentions_numbers(env):
    assert len(env) == 8 and env.name == "countdown"
    sample = env.get_sample(0)
    messages = env.get_initial_prompt(sample)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "[3, 4, 8]" in messages[1]["content"] and "20" in messages[1]["content"]
    assert messages[1]["content"].startswith("Show your work in <think>")


@pytest.mark.parametrize(
    ("completion", "why"),
    [
        ("<think>x</think><answer>(8 - 4) * 3 * 2</answer>", "uses a number that is not given"),
        ("<think>x</think><answer>8 * (4 - 3) * 3</answer>", "uses 3 twice"),
        ("<think>x</think><answer>8 * 3</answer>", "leaves 4 unused"),
        ("<think>x</think><answer>8 * 4 - 3</answer>", "wrong value"),
        ("<think>x</think><answer></answer>", "empty answer"),
        ("<think>x</think>8 / (4 - 3) * 3", "no answer tags"),
    ],
)
def test_wrong_equations_score_zero(env, completion, why):
    result = score(env, env.get_sample(0), completion)  # 3, 4, 8 -> 20
    assert result.sample_metrics["_equation_reward"] == 0.0, why


def test_other_sample_correct_answer(env):
    result = score(env, env.get_sample(6), "<think>5-2=3, 3*4=12, +3</think><answer>(5 - 2) * 4 + 3</answer>")
    assert result.total_reward == 2.0


def test_right_equation_full_reward_and_golden_answer(env):
    sample = env.get_sample(0)  # 3, 4, 8 -> 20
    result = score(env, sample, "<think>3 * 4 = 12, plus 8</think>\n<answer>3 * 4 + 8</answer><|endoftext|>")
    assert result.total_reward == 2.0
    assert result.sample_metrics == {"_format_reward": 1.0, "_equation_reward": 1.0}
    assert result.golden_answers["_equation_reward"] == "20"


def test_format_reward_levels(env):
    sample = env.get_sample(0)
    assert score(env, sample, "<answer>8</answer>").sample_metrics["_format_reward"] == 0.0
    assert (
        score(env, sample, "<think>a</think><answer>eight</answer>").sample_metrics["_format_reward"] == 0.5
    )
    assert (
        score(env, sample, "a</think><answer>1+2</answer>").sample_metrics["_format_reward"] == 1.0
    )  # <think> prepended
    assert (
        score(env, sample, "<think>a</think><answer>1</answer> trailing").sample_metrics["_format_reward"]
        == 0.0
    )


@pytest.mark.parametrize(
    "answer",
    [
        "8**4**3**9",  # exponentiation: not an operator, and would hang eval
        "__import__('os').system('x')",
        "(3).__class__",
        "8 // 4 * 3",  # floor division is not a countdown operator
        "8 / (4 - 4) * 3",  # division by zero (numbers also wrong)
        "(" * 150 + "3*8" + ")" * 150,  # over 200 chars
        "3 * 8 * 4e0",
    ],
)
def test_adversarial_answers_score_zero_quickly(env, answer):
    sample = env.get_sample(0)
    result = score(env, sample, f"<think>x</think><answer>{answer}</answer>")
    assert result.sample_metrics["_equation_reward"] == 0.0


def test_huge_completion_is_scored_without_error(env):
    result = score(
        env, env.get_sample(0), "<think>" + "x" * 2_000_000 + "</think><answer>(3 * 4) + 8</answer>"
    )
    assert result.total_reward == 2.0


def test_arithmetic_interpreter_matches_python_on_plain_arithmetic():
    rng = random.Random(1)
    for _ in range(200):
        inner = f"({rng.randint(1, 99)} {rng.choice('+-*/')} {rng.randint(1, 99)})"
        expr = f"{inner} {rng.choice('+-*')} {rng.randint(1, 9)}"
        assert evaluate_arithmetic(expr) == pytest.approx(eval(expr))


def test_procedural_problems_are_seeded_and_solvable():
    env_a = get_environment("countdown", dataset_name="procedural", procedural_num_samples=50, seed=3)
    env_b = get_environment("countdown", dataset_name="procedural", procedural_num_samples=50, seed=3)
    assert [s.prompt for s in env_a.samples] == [s.prompt for s in env_b.samples]
    for sample in env_a.samples:
        meta = sample.metadata
        assert 3 <= len(meta["nums"]) <= 4
        assert equation_is_correct(meta["solution"], meta["nums"], meta["target"]), meta
    nums, target, solution = generate_problem(random.Random(0))
    assert equation_is_correct(solution, nums, target)


def test_procedural_difficulty_is_settable_and_checked():
    easy = get_environment(
        "countdown",
        dataset_name="procedural",
        procedural_num_samples=100,
        procedural_min_numbers=2,
        procedural_max_numbers=3,
        procedural_max_number=9,
        procedural_max_target=50,
    )
    counts = {len(s.metadata["nums"]) for s in easy.samples}
    assert counts == {2, 3}
    for sample in easy.samples:
        meta = sample.metadata
        assert max(meta["nums"]) <= 9 and 1 <= meta["target"] <= 50, meta
        assert equation_is_correct(meta["solution"], meta["nums"], meta["target"]), meta
    with pytest.raises(ValueError, match="procedural_min_numbers <= procedural_max_numbers, got 4 and 3"):
        get_environment(
            "countdown", dataset_name="procedural", procedural_min_numbers=4, procedural_max_numbers=3
        )
    with pytest.raises(ValueError, match="procedural_max_target must be >= 1"):
        get_environment("countdown", dataset_name="procedural", procedural_max_target=0)


def test_prompts_are_settable(env):
    custom = get_environment(
        "countdown",
        dataset_name="procedural",
        system_prompt="SYS",
        instruction_prompt="INSTR",
        add_thinking_prefix=True,
    )
    messages = custom.get_initial_prompt(custom.get_sample(0))
    assert messages[0] == {"role": "system", "content": "SYS"}
    assert messages[1]["content"].startswith("INSTR\n\n")
    assert messages[-1] == {"role": "assistant", "content": "<think>"}
    with pytest.raises(TypeError, match="dataset_nme"):
        get_environment("countdown", dataset_nme="x")


def test_missing_dataset_error_names_the_dataset():
    env = get_environment("countdown", dataset_name="no-such-org/no-such-dataset-xyz")
    with pytest.raises(Exception, match="no-such-org/no-such-dataset-xyz"):
        env.load_dataset()
