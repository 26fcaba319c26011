"""Tool calling: schemas, both call formats, execution (sync/async/errors), metrics, records."""

import asyncio
from typing import Literal

import pytest

from refractor.envs import (
    RewardResult,
    Sample,
    ToolEnvironment,
    TrajectoryStep,
    get_environment,
    score_rollout,
)
from refractor.envs.tools import func_to_tool_schema, parse_function_tool_calls, parse_xml_tool_calls


def search(query: str, limit: int = 3, tags: list[str] | None = None, mode: Literal["a", "b"] = "a") -> str:
    """Search the notes.

    Args:
        query: Text to look for.
        limit: How many hits to return.
    """
    return f"{limit} hits for {query}"


async def slow_echo(text: str) -> str:
    """Echo after a pause."""
    await asyncio.sleep(0.01)
    return text


async def sleeper(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "woke"


def crash() -> str:
    raise RuntimeError("disk on fire")


def test_schema_from_type_hints_and_docstring():
    fn = func_to_tool_schema(search)["function"]
    assert fn["name"] == "search" and fn["description"] == "Search the notes."
    props = fn["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "Text to look for."}
    assert props["limit"] == {"type": "integer", "description": "How many hits to return."}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["mode"] == {"type": "string", "enum": ["a", "b"]}
    assert fn["parameters"]["required"] == ["query"]


def test_xml_parsing_skips_invalid_json():
    text = (
        '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call> and '
        '<TOOL_CALL>{"name": "crash"}</TOOL_CALL> <tool_call>{not json}</tool_call>'
    )
    calls = parse_xml_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("search", {"query": "x"}), ("crash", {})]


def test_function_parsing_handles_nesting_strings_and_rejects_code():
    text = (
        'I will call search("a (tricky) \\"string\\"", limit=2) '
        'then search(query="""x)y""", tags=["a", "b"]) '
        'and research(1) and search(__import__("os")) and slow_echo(-3)'
    )
    calls = parse_function_tool_calls(text, ["search", "slow_echo"])
    assert [(c.name, c.arguments) for c in calls] == [
        ("search", {"0": 'a (tricky) "string"', "limit": 2}),
        ("search", {"query": "x)y", "tags": ["a", "b"]}),
        ("slow_echo", {"0": -3}),
    ]


class NotesEnv(ToolEnvironment):
    def load_dataset(self, num_samples=-1, **kwargs):
        self._samples = [Sample("find notes")]
        return self._samples

    async def compute_reward(self, state, eos_token=""):
        return RewardResult(
            total_reward=float(state.custom.get("tool_success_count", 0)),
            sample_metrics=self.get_tool_metrics(state),
        )


def play(env, replies):
    async def main():
        sample = env.samples[0]
        state = env.create_initial_state(sample)
        messages = env.get_initial_prompt(sample)
        logged = []
        for text in replies:
            completion = [{"role": "assistant", "content": text}]
            state.add_step(TrajectoryStep(prompt=messages, completion=completion))
            env_msgs = await env.env_response(messages + completion, state)
            logged.append(state.pop_pending_tool_calls())
            done, reason = env.is_done(state)
            if done:
                state.stop_reason = reason
                break
            messages = env.get_next_prompt_messages(state, env_msgs)
        return state, messages, logged, await score_rollout(env, state, timeout_s=10)

    return asyncio.run(main())


def test_tool_env_executes_errors_and_counts():
    env = NotesEnv(tools=[search, slow_echo, crash, sleeper], system_prompt="Be brief.", tool_timeout_s=0.2)
    system = env.get_initial_prompt(env.samples[0])[0]["content"]
    assert (
        system.startswith("Be brief.\n\n# Available Tools")
        and "## slow_echo" in system
        and "<tool_call>" in system
    )
    turn1 = (
        '<tool_call>{"name": "search", "arguments": {"query": "rl"}}</tool_call>'
        '<tool_call>{"name": "slow_echo", "arguments": {"text": "hi"}}</tool_call>'
    )
    turn2 = (
        '<tool_call>{"name": "crash", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {"wrong": 1}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "sleeper", "arguments": {"seconds": 5}}</tool_call>'
    )
    state, messages, logged, outcome = play(env, [turn1, turn2, "All done."])
    assert state.stop_reason == "final_answer" and state.num_turns == 3
    assert messages[3] == {
        "role": "user",
        "content": "Tool 1: [search] 3 hits for rl\nTool 2: [slow_echo] hi",
        "turn_type": "tool_result",
    }
    errors = messages[5]["content"].splitlines()
    assert errors[0] == "Tool 1: [crash] Error: RuntimeError: disk on fire"
    assert errors[1].startswith("Tool 2: [search] Error: TypeError:")
    assert (
        errors[2]
        == "Tool 3: [nope] Error: Unknown tool 'nope'. Available tools: search, slow_echo, crash, sleeper"
    )
    assert errors[3].startswith("Tool 4: [sleeper] Error: TimeoutError")
    assert [len(x) for x in logged] == [2, 4, 0]
    assert [(r.tool_name, r.success, r.error) for r in logged[1]] == [
        ("crash", False, "RuntimeError"),
        ("search", False, "argument_error"),
        ("nope", False, "unknown_tool"),
        ("sleeper", False, "timeout"),
    ]
    assert logged[0][0].arguments == '{"query": "rl"}'
    for record in logged[0] + logged[1]:  # every call is timed, the one cut by the timeout too
        assert record.started_at <= record.ended_at
    sleeper_call = logged[1][3]
    assert sleeper_call.ended_at - sleeper_call.started_at >= 0.2
    metrics = outcome.result.sample_metrics
    assert metrics["total_tool_calls"] == 6 and metrics["tool_success_count"] == 2
    assert metrics["tool_error_count"] == 4 and metrics["tool_success_rate"] == pytest.approx(2 / 6)
    assert metrics["search_calls"] == 2 and metrics["crash_calls"] == 1 and metrics["unique_tools_used"] == 4


def test_max_turns_ends_a_tool_loop():
    env = NotesEnv(tools=[search], max_turns=2)
    call = '<tool_call>{"name": "search", "arguments": {"query": "again"}}</tool_call>'
    state, _, _, _ = play(env, [call, call, call])
    assert state.stop_reason == "max_turns_reached" and state.num_turns == 2


def test_calculator_tools_function_format_solves_a_problem():
    env = get_environment("calculator_tools", tool_call_format="function", num_problems=5)
    sample = env.samples[0]
    a, op1, b, op2, c = sample.metadata["expression"].replace("(", "").replace(")", "").split()
    names = {"+": "add", "-": "subtract", "*": "multiply", "/": "divide"}
    first = f"{names[op1]}({a}, {b})"
    state, messages, _, _ = play(env, [first, "x"])
    intermediate = messages[-1]["content"].split("] ")[1]
    second = f"{names[op2]}({intermediate}, {c})"
    state, messages, _, outcome = play(env, [first, second, "f"])
    final = messages[-1]["content"].split("] ")[1]
    state, _, _, outcome = play(env, [first, second, f"<answer>{final}</answer>"])
    assert outcome.result.sample_metrics["correct"] == 1.0 and outcome.result.total_reward == 1.0
    assert outcome.result.sample_metrics["total_tool_calls"] == 2
    state, _, _, outcome = play(env, ["<answer>12345678</answer>"])
    assert outcome.result.total_reward == 0.0 and outcome.result.sample_metrics["total_tool_calls"] == 0
