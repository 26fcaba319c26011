"""AsyncLLMEngine: concurrent requests, cancellation aborts, pause modes, thread-safe weight updates."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams
from refractor.inference.engine.async_engine import AsyncLLMEngine


@pytest.fixture
def engine(tiny_qwen2_path, async_scheduling):
    config = EngineConfig(
        max_model_len=512, kv_cache_memory_gb=0.02, block_size=16, async_scheduling=async_scheduling
    )
    eng = AsyncLLMEngine(LLMEngine.from_pretrained(tiny_qwen2_path, config))
    yield eng
    eng.shutdown()


LONG = SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True, seed=0)


async def _until(predicate, timeout=10.0):
    for _ in range(int(timeout / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


def test_concurrent_generate_and_cancel(engine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = await asyncio.gather(
            *(engine.generate([3 + i, 4, 5], params, request_id=f"q{i}") for i in range(20))
        )
        assert [o.request_id for o in outs] == [f"q{i}" for i in range(20)]
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
        task = asyncio.create_task(engine.generate([1, 2, 3], LONG, request_id="cancel-me"))
        await _until(lambda: engine.stats().num_running == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until(lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0)
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.generate(list(range(3, 600)), params)

    asyncio.run(main())


def test_pause_keep_abort_wait(engine):
    async def main():
        task = asyncio.create_task(engine.generate([1, 2, 3], LONG, request_id="kept"))
        await _until(lambda: "kept" in engine.engine.requests)
        # The stats the pause's caller reads already count the step the pause recorded, even while
        # the engine thread is busy with the next command (it refreshes them between steps too).
        gate = threading.Event()
        pausing = asyncio.create_task(engine.pause("keep"))
        await asyncio.sleep(0)  # the pause's command is queued first
        engine.call(lambda: gate.wait(10))
        try:
            await pausing
            assert engine.is_paused
            frozen = engine.engine.requests["kept"].seqs[0].num_output_tokens
            assert engine.stats().generation_tokens_total == frozen
        finally:
            gate.set()
        queued = asyncio.create_task(
            engine.generate([4, 5], SamplingParams(max_tokens=2, ignore_eos=True), request_id="queued")
        )
        await asyncio.sleep(0.1)
        assert engine.engine.requests["kept"].seqs[0].num_output_tokens == frozen and not queued.done()
        await engine.resume()
        kept = await task
        assert len(kept.outputs[0].token_ids) == 400 and (await queued).outputs[0].finish_reason == "length"

        task = asyncio.create_task(engine.generate([1, 2, 3], LONG, request_id="dropped"))
        await _until(lambda: "dropped" in engine.engine.requests)
        await engine.pause("abort")
        dropped = await task
        assert dropped.outputs[0].finish_reason == "abort" and 0 < len(dropped.outputs[0].token_ids) < 400
        await engine.resume()

        short = asyncio.create_task(
            engine.generate([1, 2], SamplingParams(max_tokens=30, ignore_eos=True), request_id="short")
        )
        await _until(lambda: "short" in engine.engine.requests)
        await engine.pause("wait")
        assert not engine.engine.requests  # it ran to completion before the pause took effect
        assert (await short).outputs[0].finish_reason == "length"
        late = asyncio.create_task(engine.generate([1, 2], SamplingParams(max_tokens=3), request_id="late"))
        await asyncio.sleep(0.05)
        assert not late.done()  # queued while paused
        await engine.resume()
        assert len((await late).outputs[0].token_ids) == 3
        assert await engine.abort() == 0

    asyncio.run(main())


def test_the_pause_state_machine_never_hangs_nor_loses_a_resume(engine):
    """A wait-pause on an engine paused in keep mode returns at once (it used to wait forever for
    frozen requests and then swallow the next resume); pauses are not counted: one resume ends
    them; a resume during a wait-pause's drain cancels it; resume while running is a no-op."""

    async def bounded(coro):
        return await asyncio.wait_for(coro, timeout=30)

    async def main():
        frozen = asyncio.create_task(engine.generate([1, 2, 3], LONG, request_id="frozen"))
        await _until(lambda: "frozen" in engine.engine.requests)
        await bounded(engine.pause("keep"))
        await bounded(engine.pause("wait"))  # already paused: returns at once
        await bounded(engine.pause("keep"))  # nested: still one pause
        assert engine.is_paused and not frozen.done()
        await bounded(engine.resume())  # one resume ends it, and the frozen request goes on
        assert not engine.is_paused
        await _until(lambda: engine.engine.requests["frozen"].seqs[0].num_output_tokens > 5)
        await bounded(engine.resume())  # resume while running: no-op
        assert not engine.is_paused

        # abort while paused in keep mode: the frozen request ends, the engine stays paused
        await bounded(engine.pause("keep"))
        await bounded(engine.pause("abort"))
        assert (await bounded(frozen)).outputs[0].finish_reason == "abort" and engine.is_paused
        await bounded(engine.resume())

        # a resume during a wait-pause's drain: the pause returns without pausing; held requests run
        draining = asyncio.create_task(engine.generate([4, 5, 6], LONG, request_id="draining"))
        await _until(lambda: "draining" in engine.engine.requests)
        waiters = [asyncio.create_task(engine.pause("wait")) for _ in range(2)]  # two callers, one drain
        await _until(lambda: engine.is_paused)
        held = asyncio.create_task(
            engine.generate([7, 8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        )
        await asyncio.sleep(0.1)
        assert not held.done() and not any(w.done() for w in waiters)
        await bounded(engine.resume())
        await bounded(asyncio.gather(*waiters))
        assert not engine.is_paused
        assert len((await bounded(held)).outputs[0].token_ids) == 4
        assert len((await bounded(draining)).outputs[0].token_ids) == 400

        # a wait-pause that drains by itself ends paused; a resume then ends that pause
        await bounded(engine.pause("wait"))
        assert engine.is_paused and not engine.engine.requests
        await bounded(engine.resume())
        assert not engine.is_paused

    asyncio.run(main())


def test_update_weights_from_another_thread(engine, tiny_qwen2_path):
    async def main():
        before = await engine.generate(
            [7, 8, 9], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        )
        zeros = [(name, torch.zeros_like(p)) for name, p in engine.named_parameters() if "mlp" in name]
        copied = await asyncio.to_thread(engine.update_weights, zeros, 3)
        assert copied == len(zeros) and engine.weight_version == 3
        after = await engine.generate(
            [7, 8, 9], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        )
        assert after.outputs[0].weight_versions[0].version == 3
        assert after.outputs[0].token_ids != before.outputs[0].token_ids

    asyncio.run(main())
