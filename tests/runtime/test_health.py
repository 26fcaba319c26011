"""Heartbeats and timeouts name the component that died or hung: real server processes, real Ray actors."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray

from refractor.inference.client import InferenceClient
from refractor.inference.native_launcher import start_native_server
from refractor.runtime.health import ComponentFailure, HeartbeatSettings, ServerWatchdog, await_ranks
from refractor.testing import TEST_CONTROL_TOKEN


@pytest.fixture(scope="module")
def server(tiny_qwen2_path):
    handle = start_native_server(
        str(tiny_qwen2_path),
        engine_args={"max_model_len": 256, "kv_cache_memory_gb": 0.05},
        control_token=TEST_CONTROL_TOKEN,
    )
    yield handle
    handle.stop()


async def _watch_until_failure(watchdog: ServerWatchdog, limit_s: float) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(ComponentFailure) as err:
        await asyncio.wait_for(watchdog.watch(), limit_s)
    return str(err.value), time.monotonic() - start


def test_a_healthy_server_passes_and_a_hung_one_is_named_after_the_timeout(server):
    async def scenario():
        async with InferenceClient(server.url, name="server-7", control_token=TEST_CONTROL_TOKEN) as client:
            watchdog = ServerWatchdog([client], HeartbeatSettings(interval_s=0.2, timeout_s=3.0))
            for _ in range(3):
                await watchdog.check()  # answers: no failure
            os.kill(server.process.pid, signal.SIGSTOP)  # alive but answering nothing
            try:
                return await _watch_until_failure(watchdog, limit_s=30)
            finally:
                os.kill(server.process.pid, signal.SIGCONT)

    message, took = asyncio.run(scenario())
    assert "server-7" in message and "/health" in message and "heartbeat_timeout_s" in message
    assert 3.0 <= took < 20


def test_a_dead_server_process_is_named_at_once_with_its_log(tiny_qwen2_path):
    handle = start_native_server(
        str(tiny_qwen2_path),
        engine_args={"max_model_len": 256, "kv_cache_memory_gb": 0.05},
        control_token=TEST_CONTROL_TOKEN,
    )

    async def process_check(name: str) -> tuple[bool, str]:
        return handle.alive(), handle.exit_report()

    async def scenario():
        async with InferenceClient(handle.url, name="server-3", control_token=TEST_CONTROL_TOKEN) as client:
            watchdog = ServerWatchdog(
                [client], HeartbeatSettings(interval_s=0.2, timeout_s=600.0), process_check
            )
            await watchdog.check()
            os.killpg(handle.process.pid, signal.SIGKILL)
            return await _watch_until_failure(watchdog, limit_s=30)

    try:
        message, took = asyncio.run(scenario())
    finally:
        handle.stop()
    assert "server-3" in message and "process exited" in message and "last log lines" in message
    assert took < 10  # not the 600 s heartbeat timeout: a dead process is reported at the next beat


@ray.remote(num_cpus=0)
class Rank:
    def work(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    def die(self) -> None:
        os._exit(1)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_trainer_calls_name_the_rank_that_hangs_or_dies(local_ray):
    ranks = [Rank.remote() for _ in range(3)]
    assert (
        asyncio.run(await_ranks([r.work.remote(0) for r in ranks], "train_step (step 0)", 60)) == ["done"] * 3
    )

    with pytest.raises(ComponentFailure) as err:
        asyncio.run(
            await_ranks(
                [ranks[0].work.remote(0), ranks[1].work.remote(60), ranks[2].work.remote(0)],
                "train_step (step 4)",
                timeout_s=2,
            )
        )
    message = str(err.value)
    assert (
        "rank(s) [1] did not finish train_step (step 4) within 2 s" in message
        and "rank(s) [0, 2] did" in message
    )

    with pytest.raises(ComponentFailure, match=r"trainer rank 2 died during the weight sync"):
        asyncio.run(
            await_ranks(
                [ranks[0].work.remote(0), ranks[1].work.remote(0), ranks[2].die.remote()],
                "the weight sync to version 3",
                timeout_s=60,
            )
        )
    for r in ranks:
        ray.kill(r)
