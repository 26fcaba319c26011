"""A request whose work raises inside an engine step fails alone, with its reason; the other requests
of the step finish as if it had never been there. An engine that fails for every request fails them
all and keeps serving.

No input gets past validation and then raises in a step, so the faults are injected: the real model
runner is wrapped to raise for the sequences a predicate picks (a stand-in for a kernel that fails on
one request's data), and a real tokenizer decode is wrapped to raise (the stop-string check).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from transformers import AutoTokenizer

from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams
from refractor.inference.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from refractor.inference.server import create_app
from refractor.testing import TEST_CONTROL_TOKEN

CONTROL = {"Authorization": f"Bearer {TEST_CONTROL_TOKEN}"}


@pytest.fixture
def config(async_scheduling) -> EngineConfig:
    return EngineConfig(
        max_model_len=128,
        kv_cache_memory_gb=0.01,
        dtype="float32",
        device="cpu",
        async_scheduling=async_scheduling,
    )


POISON = 99  # a prompt starting with this token id makes the model runner raise


def inject_runner_fault(core: LLMEngine, poisoned) -> None:
    """The runner raises for any batch that holds a sequence ``poisoned(seq, done)`` picks, where
    ``done`` counts the output tokens before the one the step computes (a step launched ahead of
    the host computes the token after the host's last)."""
    run = core.runner.run

    def faulty(seqs, is_prefill, next_ids=None):
        ahead = int(next_ids is not None)
        bad = sorted({s.request_id for s in seqs if poisoned(s, s.num_output_tokens + ahead)})
        if bad:
            raise RuntimeError(f"injected fault in the model for {bad}")
        return run(seqs, is_prefill, next_ids)

    core.runner.run = faulty


async def _until(predicate, timeout=20.0):
    for _ in range(int(timeout / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("failing_step", ["prefill", "decode"])
def test_a_request_failing_inside_the_step_fails_alone_and_the_others_match_their_solo_runs(
    tiny_qwen2_path, failing_step, config
):
    engine = AsyncLLMEngine(LLMEngine.from_pretrained(tiny_qwen2_path, config))
    app = create_app(
        engine, AutoTokenizer.from_pretrained(tiny_qwen2_path), "t", control_token=TEST_CONTROL_TOKEN
    )
    # decode: the faulty request fails at its fourth token, when every request holds KV
    fails_at = 0 if failing_step == "prefill" else 3
    inject_runner_fault(engine.engine, lambda seq, done: seq.token_ids[0] == POISON and done == fails_at)
    greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    good = [{"prompt": [1, 2, i + 3], **greedy} for i in range(19)]
    bad = {"prompt": [POISON, 2, 3], **greedy, "n": 3}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
            # paused, all 20 queue up; on resume they are prefilled in one step with the faulty one
            await client.post("/pause", params={"mode": "keep"}, headers=CONTROL)
            tasks = [asyncio.ensure_future(client.post("/v1/completions", json=b)) for b in [bad, *good]]
            await _until(lambda: engine.stats().num_waiting == 19 + 3)
            await client.post("/resume", headers=CONTROL)
            together = await asyncio.gather(*tasks)
            alone = [await client.post("/v1/completions", json=b) for b in good]
        return together, alone

    try:
        (failed, *together), alone = asyncio.run(main())
        stats = engine.call(engine.engine.stats).result()  # read on the engine thread: current
    finally:
        engine.shutdown()
    assert [r.status_code for r in together] == [200] * 19
    assert failed.status_code == 500, failed.text
    message = failed.json()["error"]["message"]
    assert "failed in the engine" in message and "injected fault in the model" in message
    assert "Traceback" not in failed.text
    assert [r.status_code for r in alone] == [200] * 19
    tokens = [r.json()["choices"][0]["token_ids"] for r in together]
    assert all(len(t) == 8 for t in tokens)
    assert tokens == [r.json()["choices"][0]["token_ids"] for r in alone]
    assert stats.kv_cache_usage == 0 and stats.num_waiting == 0  # the failed request's KV was freed


def test_an_engine_failing_for_every_request_fails_them_all_and_serves_again(tiny_qwen2_path, config):
    engine = AsyncLLMEngine(LLMEngine.from_pretrained(tiny_qwen2_path, config))
    run = engine.engine.runner.run
    inject_runner_fault(engine.engine, lambda seq, done: True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main():
        await engine.pause("keep")
        tasks = [asyncio.ensure_future(engine.generate([1, 2, i + 3], params)) for i in range(4)]
        await _until(lambda: engine.stats().num_waiting == 4)
        await engine.resume()
        everyone = await asyncio.gather(*tasks, return_exceptions=True)
        alone = await asyncio.gather(engine.generate([5, 6], params), return_exceptions=True)
        engine.engine.runner.run = run  # the fault clears
        healthy = await engine.generate([5, 6], params)
        return everyone, alone, healthy

    try:
        everyone, (alone,), healthy = asyncio.run(main())
        alive = engine.is_alive
        usage = engine.call(engine.engine.stats).result().kv_cache_usage
    finally:
        engine.shutdown()
    assert all(isinstance(e, EngineDeadError) for e in everyone), everyone
    assert "failed for each of its 4 requests, even run alone" in str(everyone[0])
    # a step of one request cannot tell a faulty request from a faulty engine: that request fails
    assert isinstance(alone, RequestFailedError) and "injected fault" in str(alone)
    assert alive and usage == 0
    assert len(healthy.outputs[0].token_ids) == 4 and healthy.outputs[0].finish_reason == "length"


def test_a_failing_stop_string_check_fails_only_its_request(tiny_qwen2_path, config):
    def decode(token_ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected: undecodable output")

    core = LLMEngine.from_pretrained(tiny_qwen2_path, config, detokenize=decode)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with_stop = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=["never"], n=2)
    failed, ok = core.generate([[1, 2, 3], [4, 5, 6]], [with_stop, plain])
    assert failed.error is not None and "UnicodeDecodeError" in failed.error and "injected" in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["error", "error"]
    assert ok.error is None and len(ok.outputs[0].token_ids) == 6
    assert ok.outputs[0].token_ids == core.generate([[4, 5, 6]], plain)[0].outputs[0].token_ids
    assert core.block_manager.usage == 0 and not core.requests


def test_values_that_would_break_a_step_are_refused_up_front(config):
    """A subnormal temperature made every log-prob NaN, and a top-logprobs count above the
    vocabulary made the batch's top-k raise: both are refused before the request joins a batch."""
    from refractor.testing import TinyModelSpec, build_tiny_model

    with pytest.raises(ValueError, match="temperature must be 0 .greedy. or a finite number >= 1e-06"):
        SamplingParams(temperature=1e-40)
    core = LLMEngine.from_pretrained(build_tiny_model(TinyModelSpec(vocab_size=16)), config)
    with pytest.raises(ValueError, match=r"logprobs \(20\) exceeds the vocabulary of 16 tokens"):
        core.add_request("r", [1, 2, 3], SamplingParams(logprobs=20))
    assert not core.requests
