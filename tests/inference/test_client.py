"""InferenceClient against a running native server: generate, cancellation aborts, control, errors."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from refractor.inference.client import InferenceClient, InferenceServerError, Sampling, WeightVersionSpan
from refractor.inference.native_launcher import start_native_server
from refractor.inference.process import free_port
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
            for _ in range(1000):
                if (await client.metrics()).get("vllm:num_requests_running", 0) >= 1:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the request never ran")
            # frozen in flight, so it is still there when the abort comes however fast the machine is
            await client.pause("keep")
            try:
                assert await client.abort(["mine"]) == 1
            finally:
                await client.resume()
            aborted = await asyncio.wait_for(running, 10)
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


class ClosingServer:
    """A raw HTTP server that reads each request and closes the first ``closes`` connections without
    answering (what a keep-alive timeout does to a request sent as it fires), then answers."""

    def __init__(self, closes: int):
        self.closes = closes
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await reader.readuntil(b"\r\n\r\n")
        if self.connections <= self.closes:
            writer.close()
            return
        body = b'{"is_paused": false}'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
        )
        writer.write(body)
        await writer.drain()
        writer.close()


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize(("closes", "expected"), [(1, "answered"), (2, "failed")])
def test_a_request_on_a_connection_closed_under_it_is_sent_once_more(closes, expected, method):
    """GET and POST alike: once, counted (the transport's own resend of idempotent requests is off)."""

    async def main():
        closing = ClosingServer(closes)
        server = await asyncio.start_server(closing.handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with InferenceClient(url, control_token=TEST_CONTROL_TOKEN) as client:
            try:
                if method == "GET":
                    assert await client.is_paused() is False
                else:
                    await client.resume()
                outcome = "answered"
            except InferenceServerError as err:
                assert "ServerDisconnectedError" in str(err) and "(twice)" in str(err) and url in str(err)
                outcome = "failed"
            retries = client.closed_connection_retries
        server.close()
        return outcome, retries, closing.connections

    assert asyncio.run(main()) == (expected, 1, 2)  # one retry, never more


def test_1024_concurrent_requests_and_256_aborted_leave_the_server_idle(server):
    """256 long requests fill the engine's 256 slots and are aborted mid-flight while 1,024 more are
    sent, all of which are answered: no transport error, no retry, and afterwards the server holds no
    sequence and no KV block."""
    from refractor.inference.process import raise_open_file_limit

    raise_open_file_limit()  # 1,280 sockets at once
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 40, (1024,), generator=gen).tolist()
    budgets = torch.randint(1, 12, (1024,), generator=gen).tolist()

    async def gauges(client) -> list[float]:
        metrics = await client.metrics()
        names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        return [metrics[f"vllm:{name}"] for name in names]

    async def main():
        async with InferenceClient(
            server.url, control_token=TEST_CONTROL_TOKEN, max_connections=2048
        ) as client:
            doomed = [
                asyncio.create_task(client.generate([5, 6, 7], Sampling(max_tokens=500, ignore_eos=True)))
                for _ in range(256)
            ]
            start = time.monotonic()
            while (await gauges(client))[0] < 256:  # all of them running: mid-flight from here on
                assert time.monotonic() - start < 60, "the long requests did not start"
                await asyncio.sleep(0.02)
            for task in doomed:  # at once: none can have generated its 500 tokens yet
                task.cancel()
            answered = [
                asyncio.create_task(
                    client.generate(list(range(3, 3 + n)), Sampling(max_tokens=m, ignore_eos=True, seed=i))
                )
                for i, (n, m) in enumerate(zip(lengths, budgets, strict=True))
            ]
            aborted = await asyncio.gather(*doomed, return_exceptions=True)
            results = await asyncio.gather(*answered, return_exceptions=True)
            start = time.monotonic()
            while (now := await gauges(client)) != [0, 0, 0]:
                assert time.monotonic() - start < 30, f"the server is not idle: running, waiting, KV {now}"
                await asyncio.sleep(0.05)
            return results, aborted, client.closed_connection_retries

    results, aborted, retries = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == [], errors[:3]
    assert [len(r.token_ids) for r in results] == budgets
    assert all(isinstance(a, asyncio.CancelledError) for a in aborted)
    assert retries == 0


def test_a_run_s_clients_hold_a_connection_for_every_lane_and_spare_ones_for_control():
    from types import SimpleNamespace

    from refractor.config.schema import RefractorConfig
    from refractor.train import _http_servers

    def clients(prompts: int, group_size: int) -> list[InferenceClient]:
        cfg = RefractorConfig(
            environments=[{"name": "countdown"}],
            max_concurrent_prompts_per_server=prompts,
            group_size=group_size,
        )
        servers = [SimpleNamespace(url=f"http://127.0.0.1:{port}", name=f"s{port}") for port in (1, 2)]
        made = _http_servers(servers, cfg, TEST_CONTROL_TOKEN)
        for client in made:
            asyncio.run(client.close())
        return made

    # 2,048 lanes per server (128 prompts x 16 samples): every lane and as many control requests
    assert [c.max_connections for c in clients(128, 16)] == [4096, 4096]
    # a few lanes: the default limit, which leaves room for control requests
    assert [c.max_connections for c in clients(8, 4)] == [1024, 1024]
