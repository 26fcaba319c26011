"""EvalRunner against a real native-engine server (tiny random Qwen2): K completions per prompt,
per-server lane bounds, max_tokens clamped to the context, a prompt too long for the context
recorded as a failed completion, raw vs chat-templated prompts, and a multi-turn eval."""

from __future__ import annotations

import asyncio

import pytest
from orch_fakes import ToyChatEnv
from transformers import AutoTokenizer

from refractor.config.schema import EvalEntry
from refractor.evals import Eval, aggregate, parse_pass_k
from refractor.inference.client import InferenceClient
from refractor.inference.native_launcher import start_native_server
from refractor.orchestrator.chat import ChatTokens
from refractor.orchestrator.eval_runner import EvalIds, EvalRunner, LoadedEval, build_task
from refractor.orchestrator.rollout import RolloutSettings
from refractor.records import EvalMetricsResult, Sample
from refractor.testing import TEST_CONTROL_TOKEN

MAX_MODEL_LEN = 96


class LetterEval(Eval):
    """Standalone: ``has_a`` = the completion contains the letter a. Prompt 2 is too long."""

    def load_dataset(self, num_samples=-1, **kwargs):
        self._samples = [Sample(f"Write some letters ({i})", "a") for i in range(2)]
        self._samples.append(Sample("word " * 120, "a"))
        return self._samples

    async def compute_eval_metrics(self, completion, sample, eos_token=""):
        return EvalMetricsResult(metrics={"has_a": float("a" in completion), "chars": float(len(completion))})


class CountingServer:
    """A real client under its own name; records how many of its requests run at once."""

    def __init__(self, url: str, name: str) -> None:
        self.client = InferenceClient(url, name=name, control_token=TEST_CONTROL_TOKEN)
        self.name = name
        self.running = 0
        self.peak = 0
        self.calls = 0

    async def generate(self, token_ids, sampling, *, priority=0):
        self.running += 1
        self.calls += 1
        self.peak = max(self.peak, self.running)
        try:
            return await self.client.generate(token_ids, sampling, priority=priority)
        finally:
            self.running -= 1


@pytest.fixture(scope="module")
def server(tiny_qwen2_path):
    handle = start_native_server(
        str(tiny_qwen2_path),
        control_token=TEST_CONTROL_TOKEN,
        engine_args={"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_gb": 0.05, "seed": 0},
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def chat(tiny_qwen2_path):
    return ChatTokens(AutoTokenizer.from_pretrained(tiny_qwen2_path))


def settings(chat):
    return RolloutSettings(
        max_tokens=8, max_model_len=MAX_MODEL_LEN, temperature=1.0, eos_token=chat.tokenizer.eos_token
    )


def run(runner, tasks, servers, step=3, version=7):
    async def main():
        try:
            return await runner.execute(runner.plan(tasks, step, EvalIds()), servers, version)
        finally:
            for s in servers:
                await getattr(s, "client", s).close()

    return asyncio.run(main())


def test_k_completions_lanes_clamp_and_failures(server, chat):
    entry = EvalEntry(
        name="letters",
        max_tokens=500,
        temperature=0.8,
        pass_k={"at_k": {"metrics": ["has_a"], "k": [1, 4]}, "pow_k": {"metrics": ["has_a"], "k": [2]}},
    )
    ev = LetterEval()
    ev._name = "letters"
    task = build_task(LoadedEval(entry, ev, 3, parse_pass_k(entry.pass_k)), chat, settings(chat))
    assert task.settings.max_tokens == 500 and task.settings.temperature == 0.8
    servers = [CountingServer(server.url, "a"), CountingServer(server.url, "b")]
    [result] = run(EvalRunner(chat, lanes_per_server=2), [task], servers)

    rows = result.rollouts
    assert len(rows) == 3 * 4 and {r.status for r in rows} == {"eval"} and {r.step for r in rows} == {3}
    assert all(s.peak <= 2 for s in servers) and sum(s.peak for s in servers) >= 3  # lanes bound each server
    assert sum(s.calls for s in servers) == 8  # the too-long prompt never reaches a server
    ok = [r for r in rows if not r.reason]
    too_long = [r for r in rows if r.prompt_index == 2]
    assert len(ok) == 8 and {r.reason for r in too_long} == {"prompt_too_long"}
    for r in ok:
        prompt_len = len(r.prompt_ids)
        assert r.turns[0].max_tokens == MAX_MODEL_LEN - prompt_len  # 500 clamped to the context
        assert r.end_version == 7 and r.server in {"a", "b"} and 0 <= r.lane < 2
        assert r.sample_metrics["chars"] == len(r.completion_text)
    # the aggregates are exactly what the rows say
    per_prompt = [
        [
            None if r.reason else {k: r.sample_metrics[k] for k in ("has_a", "chars")}
            for r in rows
            if r.prompt_index == i
        ]
        for i in range(3)
    ]
    expected = aggregate(per_prompt, task.pass_k).metrics
    for name, value in expected.items():
        assert result.metrics[name] == pytest.approx(value), name
    assert {"pass@1/has_a", "pass@4/has_a", "pass^2/has_a"} <= set(result.metrics)
    assert result.metrics["num_prompts"] == 3 and result.metrics["num_failed"] == 4
    assert result.metrics["policy_version"] == 7
    for r in ok:  # each row carries its prompt's pass values (docs/metrics.md#eval-metrics)
        assert "pass@4/has_a" in r.sample_metrics


def test_raw_prompts_and_multi_turn_evals(server, chat):
    entry = EvalEntry(name="letters", num_samples=2, pass_k={"at_k": [2]})
    raw_eval = LetterEval(use_chat_template=False)
    raw_eval._name = "letters"
    chat_env = ToyChatEnv(n=2, max_turns=2)
    tasks = [
        build_task(LoadedEval(entry, raw_eval, 2, parse_pass_k(entry.pass_k)), chat, settings(chat)),
        build_task(LoadedEval(EvalEntry(name="chat"), chat_env, 2, parse_pass_k({})), chat, settings(chat)),
    ]
    raw_prompt = tasks[0].prompts[0]
    assert raw_prompt.prompt_ids == chat.tokenizer.encode("Write some letters (0)")
    templated = tasks[1].prompts[0]
    assert templated.prompt_ids == chat.render(chat_env.get_initial_prompt(chat_env.get_sample(0)))
    assert "<|im_start|>" in chat.tokenizer.decode(templated.prompt_ids)
    raw, multi = run(EvalRunner(chat, lanes_per_server=4), tasks, [InferenceClientNamed(server.url)])
    assert len(raw.rollouts) == 4 and all(
        r.prompt_ids == raw_prompt.prompt_ids for r in raw.rollouts if r.prompt_index == 0
    )
    assert len(multi.rollouts) == 2 and all(r.num_turns == 2 for r in multi.rollouts)
    assert "yes_count" in multi.metrics  # an environment's eval metrics default to its reward metrics


def InferenceClientNamed(url: str) -> InferenceClient:  # noqa: N802 - reads like the class it builds
    return InferenceClient(url, name="server-0", control_token=TEST_CONTROL_TOKEN)


def test_each_prompt_is_handed_over_once_when_all_its_completions_are_done(server, chat):
    entry = EvalEntry(name="letters", pass_k={"at_k": {"metrics": ["has_a"], "k": [3]}})
    ev = LetterEval()
    ev._name = "letters"
    task = build_task(LoadedEval(entry, ev, 3, parse_pass_k(entry.pass_k)), chat, settings(chat))
    handed: list[list] = []

    def on_prompt_done(rows):
        assert all(r.status == "eval" for r in rows)  # every completion finished (or failed)
        assert not any("pass@3/has_a" in r.sample_metrics for r in rows)  # before the pass values
        handed.append([r.rollout_id for r in rows])

    runner = EvalRunner(chat, lanes_per_server=2)
    servers = [CountingServer(server.url, "a")]

    async def main():
        try:
            return await runner.execute(runner.plan([task], 1, EvalIds()), servers, 1, on_prompt_done)
        finally:
            await servers[0].client.close()

    [result] = asyncio.run(main())
    assert sorted(map(sorted, handed)) == sorted(
        sorted(r.rollout_id for r in result.rollouts if r.prompt_index == i) for i in range(3)
    )
