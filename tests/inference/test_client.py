"""InferenceClient against a running native server: generate, cancellation aborts, control, errors."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from refractor.inference.client import InferenceClient, InferenceServerError, Sampling, WeightVersionSpan
from refractor.inference.process import free_port
from refractor.inference.server import start_native_server
from refractor.testing import TEST_CONTROL_TOKEN


@pytest.fixture(scope="module")
def server(tiny_qwen3_path):
    handle = start_native_server(
        str(tiny_qwen3_path),
        engine_args={"max_model_len": 512, "kv_cache_memory_gb": 0.05},
        control_token=TEST_CONTROL_TOKEN,
    )
    yield handle
    handle.stop()


def test_generate_tokens_logprobs_versions(server, tiny_qwen3_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_path, dtype=torch.float32).eval()
    prompt = [11, 22, 33, 44, 55]

    async def main():
        async with InferenceClient(server.url, control_token=TEST_CONTROL_TOKEN) as client:
            one = await client.generate(
                prompt, Sampling(temperature=0.7, max_tokens=12, seed=5, ignore_eos=True)
            )
            many = await client.generate_choices(
                prompt, Sampling(temperature=1.0, max_tokens=6, n=3, seed=1, ignore_eos=True)
            )
            stopped = await client.generate(
                prompt,
                Sampling(
                    temperature=0.7,
                    max_tokens=12,
                    seed=5,
                    stop_token_ids=(one.token_ids[3],),
                    ignore_eos=True,
                ),
            )
            return one, many, stopped

    one, many, stopped = asyncio.run(main())
    assert len(one.token_ids) == 12 == len(one.logprobs) and one.finish_reason == "length"
    assert one.weight_versions == [WeightVersionSpan(0, 0, 12)]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + one.token_ids])).logits[0, len(prompt) - 1 : -1].double() / 0.7
    ref = logits.log_softmax(-1).gather(1, torch.tensor(one.token_ids)[:, None])[:, 0]
    assert (torch.tensor(one.logprobs, dtype=torch.float64) - ref).abs().max() <= 1e-4
    assert [r.index for r in many] == [0, 1, 2] and all(len(r.token_ids) == 6 for r in many)
    assert one.latency["e2e_latency"] >= one.latency["ttft"] > 0  # the server's timings, parsed
    assert all(r.latency == many[0].latency for r in many)  # one request: one account
    cut = one.token_ids.index(one.token_ids[3]) + 1
    assert stopped.token_ids == one.token_ids[:cut] and stopped.finish_reason == "stop"
    with pytest.raises(ValueError, match="generate_choices"):
        asyncio.run(InferenceClient(server.url).generate(prompt, Sampling(n=2)))


def test_cancel_aborts_on_the_server_and_control_calls(server):
    async def main():
        async with InferenceClient(server.url, control_token=TEST_CONTROL_TOKEN) as client:
            assert await client.health()
            task = asyncio.create_task(client.generate([1, 2, 3], Sampling(max_tokens=480, ignore_eos=True)))
            for _ in range(200):
                if (await client.metrics()).get("vllm:num_requests_running", 0) == 1:
                    break
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            start = time.monotonic()
            while (await client.metrics())["vllm:num_requests_running"] > 0:
                assert time.monotonic() - start < 5, "the server did not abort the cancelled request"
                await asyncio.sleep(0.01)

            await client.pause("keep")
            assert await client.is_paused()
            queued = asyncio.create_task(client.generate([4, 5], Sampling(max_tokens=3, ignore_eos=True)))
            await asyncio.sleep(0.1)
            assert not queued.done()
            await client.resume()
            assert len((await queued).token_ids) == 3
            assert not await client.is_paused()

            running = asyncio.create_task(
                client.generate([6, 7], Sampling(max_tokens=480, ignore_eos=True), request_id="mine")
            )
            await asyncio.sleep(0.2)
            assert await client.abort(["mine"]) == 1
            aborted = await running
            assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 480

            # 0: nothing pushed yet; None: a server without the weight-update routes
            assert await client.weight_version() in (None, 0)
            with pytest.raises(InferenceServerError, match="400.*max_model_len"):
                await client.generate(list(range(3, 600)), Sampling())

    asyncio.run(main())


def test_unreachable_server_is_named_after_retries():
    url = f"http://127.0.0.1:{free_port()}"

    async def main():
        async with InferenceClient(url, max_retries=2, retry_backoff_s=0.01) as client:
            assert not await client.health()
            with pytest.raises(InferenceServerError, match=f"{url} unreachable after 3 attempts"):
                await client.generate([1, 2], Sampling())

    asyncio.run(main())
