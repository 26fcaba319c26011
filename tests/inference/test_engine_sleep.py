"""Sleep mode of the native engine on CPU: the memory really goes back to the system, generation after
a wake equals generation before the sleep (greedy, token for token), requests in flight or arriving
meanwhile wait and finish, and a weight update while asleep lands and passes the canary."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import httpx
import psutil
import pytest
from native_thread_server import ThreadServer

from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams
from refractor.inference.engine.async_engine import AsyncLLMEngine
from refractor.inference.engine.llm_engine import SleepModeOffError
from refractor.models import iter_safetensors
from refractor.testing import TEST_CONTROL_TOKEN
from refractor.weight_sync.buckets import iter_buckets
from refractor.weight_sync.sender import WeightSender
from refractor.weight_sync.settings import WeightSyncSettings

CONTROL = {"Authorization": f"Bearer {TEST_CONTROL_TOKEN}"}
KV_GB = 0.25  # large enough that the allocator hands it straight back to the OS (mmap'd)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [list(range(3, 30)), list(range(40, 47)), list(range(100, 160))]
SLEEP_CONFIG = EngineConfig(
    max_model_len=512,
    max_num_seqs=8,
    kv_cache_memory_gb=KV_GB,
    block_size=16,
    dtype="float32",
    device="cpu",
    enable_sleep_mode=True,
)


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def engine(tiny_qwen2_path):
    return LLMEngine.from_pretrained(tiny_qwen2_path, SLEEP_CONFIG)


def test_sleep_gives_the_kv_cache_back_and_wake_generates_the_same_tokens(engine):
    before = _tokens(engine.generate(PROMPTS, GREEDY))
    kv_bytes = engine.runner.kv_memory.nbytes
    assert kv_bytes >= 0.9 * KV_GB * 2**30
    rss_awake = _rss()
    engine.sleep(level=1)
    assert engine.is_sleeping and engine.memory.asleep == {"kv_cache": 1, "weights": 1}
    released = rss_awake - _rss()
    assert released >= 0.9 * kv_bytes, f"sleep gave back {released / 2**20:.0f} MiB of {kv_bytes / 2**20:.0f}"
    engine.wake_up()
    assert not engine.is_sleeping
    assert engine.runner.kv_cache.untyped_storage().nbytes() == kv_bytes  # taken again (touched lazily)
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == before


def test_waking_in_two_stages_and_nothing_runs_until_both(engine):
    before = _tokens(engine.generate(PROMPTS[:1], GREEDY))
    engine.sleep(level=1)
    engine.add_request("asleep", PROMPTS[0], GREEDY)
    assert engine.step() == [] and engine.stats().num_waiting == 1
    engine.wake_up(["weights"])
    assert engine.memory.asleep == {"kv_cache": 1}
    assert engine.step() == [] and engine.is_sleeping
    engine.wake_up(["kv_cache"])
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert _tokens(done) == before


def test_running_sequences_recompute_their_kv_after_the_wake(engine, tiny_qwen2_path):
    before = _tokens(engine.generate(PROMPTS, GREEDY))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"inflight-{i}", prompt, GREEDY)
    for _ in range(6):  # a prefill, then decodes: each sequence holds KV and a few tokens
        engine.step()
    assert engine.stats().num_running == len(PROMPTS)
    engine.sleep(level=2)
    assert engine.stats().num_running == 0  # preempted: their KV went with the cache
    engine.wake_up(["weights"])
    # level 2 discarded the weights: the update refills them, as a weight sync after the wake does
    engine.update_weights(iter_safetensors(tiny_qwen2_path), recompute_kv=False)
    engine.wake_up(["kv_cache"])
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step()}
    assert [done[f"inflight-{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == before


def test_an_update_while_offloaded_lands_in_the_host_copy(engine, tiny_qwen2_path, tiny_qwen2_seed1_path):
    plain = replace(SLEEP_CONFIG, enable_sleep_mode=False, kv_cache_memory_gb=0.02)
    other = LLMEngine.from_pretrained(tiny_qwen2_seed1_path, plain)
    expected = _tokens(other.generate(PROMPTS, GREEDY))
    engine.sleep(level=1)
    assert engine.update_weights(iter_safetensors(tiny_qwen2_seed1_path), version=3) > 0
    engine.wake_up()
    outputs = engine.generate(PROMPTS, GREEDY)
    assert _tokens(outputs) == expected
    assert outputs[0].outputs[0].weight_versions[0].version == 3
    engine.update_weights(iter_safetensors(tiny_qwen2_path), version=0)


def test_misuse_gets_one_clear_error(engine, tiny_qwen2_path):
    plain = LLMEngine.from_pretrained(
        tiny_qwen2_path, EngineConfig(max_model_len=64, kv_cache_memory_gb=0.01)
    )
    with pytest.raises(SleepModeOffError, match="--enable-sleep-mode"):
        plain.sleep()
    with pytest.raises(ValueError, match="sleep level must be 1 .* or 2 .*, got 3"):
        engine.sleep(level=3)
    assert not engine.is_sleeping
    engine.sleep(level=2)
    try:
        with pytest.raises(ValueError, match=r"unknown wake_up tags \['kv'\]"):
            engine.wake_up(["kv"])
        with pytest.raises(ValueError, match=r"discarded by sleep\(level=2\).*nothing was written"):
            engine.update_weights(iter_safetensors(tiny_qwen2_path))
        engine.update_weights([], version=9)  # a version tag alone is fine
    finally:
        engine.wake_up()
        engine.update_weights(iter_safetensors(tiny_qwen2_path), version=0)


def test_async_sleep_modes(engine):
    """keep: in-flight requests finish after the wake with the tokens of an undisturbed run; abort:
    they end at once; requests sent while asleep wait for the wake."""
    before = _tokens(engine.generate(PROMPTS[:2], GREEDY))
    aengine = AsyncLLMEngine(engine)
    slow = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def scenario():
        first = asyncio.ensure_future(aengine.generate(PROMPTS[0], slow))
        while engine.generation_tokens_total == 0 or not engine.scheduler.running:
            await asyncio.sleep(0.001)
        await aengine.sleep(1, "keep")
        assert aengine.is_sleeping
        second = asyncio.ensure_future(aengine.generate(PROMPTS[1], slow))
        await asyncio.sleep(0.2)
        assert not first.done() and not second.done()
        await aengine.wake_up()
        kept = [await first, await second]
        third = asyncio.ensure_future(
            aengine.generate(PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True))
        )
        while not engine.scheduler.running:
            await asyncio.sleep(0.001)
        await aengine.sleep(1, "abort")
        aborted = await third
        await aengine.wake_up()
        return kept, aborted

    try:
        kept, aborted = asyncio.run(scenario())
    finally:
        aengine.shutdown()
    assert _tokens(kept) == before
    assert aborted.outputs[0].finish_reason == "abort"


def test_the_server_sleeps_takes_a_weight_update_and_wakes(tiny_qwen2_path, tiny_qwen2_seed1_path, hf_models):
    """Over HTTP with the run's token: /sleep, a push through the real sender while asleep (canary
    checked), /wake_up in two stages, then generation with the new weights."""
    plain = replace(SLEEP_CONFIG, enable_sleep_mode=False, kv_cache_memory_gb=0.02)
    expected = _tokens(LLMEngine.from_pretrained(tiny_qwen2_seed1_path, plain).generate(PROMPTS[:1], GREEDY))
    server = ThreadServer("sleepy-0", tiny_qwen2_path, SLEEP_CONFIG)
    awake = ThreadServer("plain-0", tiny_qwen2_path, plain)
    sender = WeightSender(
        [server.ref], WeightSyncSettings(control_token=TEST_CONTROL_TOKEN, init_timeout_s=30, timeout_s=30)
    )
    try:
        assert httpx.post(server.url + "/sleep", params={"level": 1}).status_code == 401  # no token
        response = httpx.post(awake.url + "/sleep", headers=CONTROL)
        assert response.status_code == 400 and "--enable-sleep-mode" in response.text
        response = httpx.post(server.url + "/sleep", params={"level": 1, "mode": "nap"}, headers=CONTROL)
        assert response.status_code == 400 and "nap" in response.text
        response = httpx.post(server.url + "/sleep", params={"level": 1, "mode": "keep"}, headers=CONTROL)
        assert response.json() == {"status": "sleeping", "level": 1}  # vLLM's answers
        assert httpx.get(server.url + "/is_sleeping", headers=CONTROL).json() == {"is_sleeping": True}
        result = sender.push(iter_buckets(hf_models[1].named_parameters(), 300 << 10), version=4)  # canary
        assert all(r.params_loaded == r.params_total > 0 for rs in result.reports.values() for r in rs)
        response = httpx.post(server.url + "/wake_up", params={"tags": ["weights", "kv"]}, headers=CONTROL)
        assert response.status_code == 400 and "['kv']" in response.text
        for tag, status in (("weights", "sleeping"), ("kv_cache", "awake")):
            response = httpx.post(server.url + "/wake_up", params={"tags": tag}, headers=CONTROL)
            assert response.json() == {"status": status, "tags": [tag]}
        assert httpx.get(server.url + "/is_sleeping", headers=CONTROL).json() == {"is_sleeping": False}
        outputs = asyncio.run(server.engine.generate(PROMPTS[0], GREEDY)).outputs
        assert [outputs[0].token_ids] == expected and outputs[0].weight_versions[0].version == "4"
    finally:
        sender.close()
        server.stop()
        awake.stop()
