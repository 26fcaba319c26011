"""The code environment end to end: model answers run against tests in the bubblewrap sandbox."""

import asyncio
import shutil

import pytest

from refractor.envs import get_environment, score_rollout
from refractor.envs.builtin.code import extract_program
from refractor.envs.builtin.code_tests import result_matches, stdout_matches
from refractor.envs.data import fixture_path
from refractor.envs.testing import finished_state

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```"


SUM_OK = fenced("a, b = map(int, input().split())\nprint(a + b)")
CASES = {  # sample index -> completion -> expected (passed, pass_rate, extra metric checks)
    "sum_ok": (0, SUM_OK, 1.0, 1.0),
    "sum_wrong": (0, fenced("a, b = map(int, input().split())\nprint(a - b)"), 0.0, 1 / 3),
    "sum_crash": (0, fenced("raise SystemExit(3)"), 0.0, 0.0),
    "reverse_ok_trailing_space": (1, fenced("print(input()[::-1] + '   ')"), 1.0, 1.0),
    "two_sum_class": (
        2,
        fenced(
            "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
            "        seen = {}\n        for i, n in enumerate(nums):\n"
            "            if target - n in seen: return [seen[target - n], i]\n            seen[n] = i"
        ),
        1.0,
        1.0,
    ),
    "add_function_prints_noise": (
        3,
        fenced("def add(a, b):\n    print('debug noise')\n    return a + b"),
        1.0,
        1.0,
    ),
    "no_code": (0, "The answer is to add them.", 0.0, 0.0),
    "unfinished_think": (0, "<think>let me write\n" + SUM_OK, 0.0, 0.0),
    "infinite_loop": (0, fenced("while True: pass"), 0.0, 0.0),
    "huge_output": (0, fenced("while True: print('spam' * 1000)"), 0.0, 0.0),
}


@pytest.fixture(scope="module")
def env():
    # The per-test wall limit covers sandbox start-up too: up to 8 sandboxed interpreters share the
    # machine here (two of them burn CPU until their timeout), so a correct program on a loaded 2-core
    # machine needs more than 1 s; 3 s keeps a margin while the infinite loop still times out.
    return get_environment(
        "code", dataset_name=str(fixture_path("code")), min_difficulty=0.1, timeout_per_test=3.0, pool_size=4
    )


def test_dataset_rows_tests_and_difficulty_filter(env):
    assert len(env) == 4  # the 0.0-difficulty row is filtered out
    assert env.get_sample(0).metadata["tests"][0] == ['"1 2\\n"', '"3\\n"']
    assert env.get_sample(2).metadata["fn_name"] == "twoSum"
    prompt = env.get_initial_prompt(env.get_sample(0))
    assert prompt == [
        {
            "role": "user",
            "content": "Solve the programming task below in a Python markdown code block."
            "\n\nRead two integers a and b from standard input and print their sum.",
        }
    ]


def test_rewards_on_hand_written_programs(env):
    async def main():
        await env.prepare_resources()
        try:
            jobs = {
                name: score_rollout(env, finished_state(env, env.get_sample(idx), text), timeout_s=60)
                for name, (idx, text, _, _) in CASES.items()
            }
            return dict(zip(jobs, await asyncio.gather(*jobs.values()), strict=True))
        finally:
            await env.close()

    outcomes = asyncio.run(main())
    for name, (_, _, passed, pass_rate) in CASES.items():
        outcome = outcomes[name]
        assert outcome.ok, (name, outcome.detail)
        metrics = outcome.result.sample_metrics
        assert (metrics["passed"], round(metrics["pass_rate"], 4)) == (passed, round(pass_rate, 4)), (
            name,
            metrics,
        )
        assert outcome.result.total_reward == passed
    assert outcomes["infinite_loop"].result.sample_metrics["num_timeouts"] == 3
    assert outcomes["sum_crash"].result.sample_metrics["num_errors"] == 3
    assert outcomes["huge_output"].result.sample_metrics["num_errors"] == 3
    ok = outcomes["sum_ok"].result
    assert ok.sample_metrics["num_test_cases"] == 3 and ok.sample_metrics["sandbox_error"] == 0.0
    assert {t["info_key"] for t in ok.info_turns} >= {"generated_code", "test_summary", "passed_tests"}
    wrong = {t["info_key"]: t["info_value"] for t in outcomes["sum_wrong"].result.info_turns}
    assert wrong["test_summary"] == "1/3 tests passed" and "got:" in wrong["error"]


def test_judging_rules():
    assert stdout_matches("3\n", "3") and stdout_matches("1 2  \n3\n\n", "1 2\n3")
    assert stdout_matches("0.3333333", "0.33333") and not stdout_matches("0.5", "0.6")
    assert not stdout_matches("1 2", "1 2 3")
    assert result_matches((0, 1), [0, 1]) and result_matches(3, [3]) and result_matches(0.1 + 0.2, 0.3)
    assert not result_matches([1, 0], [0, 1])
    assert extract_program("<think>x</think>```python\nA\n```") == "A\n"
    assert extract_program("<think>x ```python\nA\n```") is None
