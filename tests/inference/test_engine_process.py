"""The native engine in a process of its own (``refractor serve --engine-process``): weight pushes
reach it through the same routes, requests come back as the engine produced them, and neither
process outlives the other's death silently.

The HTTP contract itself runs against both layouts in ``test_server.py`` (its ``server`` fixture,
whose engine-process server is killed at the end to check that its engine process ends too)."""

from __future__ import annotations

import os
import re
import signal
import threading

import httpx
import pytest
import torch
from metrics_wait import wait_for_metric

from refractor.inference.engine.llm_engine import EngineStats
from refractor.inference.engine.sequence import CompletionOutput, RequestOutput, WeightVersionSpan
from refractor.inference.engine_wire import EngineStatus, decode_output, encode_output, pack, unpack
from refractor.inference.native_launcher import start_native_server
from refractor.testing import TEST_CONTROL_TOKEN
from refractor.weight_sync.buckets import iter_buckets
from refractor.weight_sync.control_plane import ServerRef
from refractor.weight_sync.sender import WeightSender
from refractor.weight_sync.settings import WeightSyncSettings

ENGINE = {"max_model_len": 512, "kv_cache_memory_gb": 0.05, "block_size": 16, "engine_process": True}
PROMPT = list(range(3, 30))


def _engine_pid(server) -> int:
    first = server.log_path.read_text().splitlines()[0]
    return int(re.search(r"engine process (\d+)", first).group(1))


def _generate(url: str, max_tokens: int = 12, timeout: float = 60) -> httpx.Response:
    body = {
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0},
    }
    return httpx.post(url + "/inference/v1/generate", json=body, timeout=timeout)


def test_outputs_cross_the_process_boundary_unchanged():
    out = RequestOutput(
        "r1",
        [1, 2, 3],
        [
            CompletionOutput(
                0, [5, 6], [-0.5, -1.25], "length", None, [WeightVersionSpan(3, 0, 2)], [1, 4], [[(5, -0.5)]]
            ),
            CompletionOutput(1, [7], [-2.0], "stop", "</s>", [WeightVersionSpan("v9", 0, 1)]),
        ],
        arrival_time=10.0,
        first_token_time=10.5,
        finish_time=11.0,
        error=None,
        scheduled_time=10.1,
    )
    assert decode_output(unpack(pack(encode_output(out)))) == out
    status = EngineStatus(
        True, False, EngineStats(3, 1, 0.25, 10, 20, 0, 7, 5, 2, 1.5), {"torch_allocated_gb": 1.0}
    )
    assert EngineStatus.decode(unpack(pack(status.encode()))) == status


def test_a_weight_push_reaches_the_engine_process_and_its_death_is_reported(
    tiny_qwen2_path, hf_models, hf_token_logprobs
):
    server = start_native_server(str(tiny_qwen2_path), control_token=TEST_CONTROL_TOKEN, engine_args=ENGINE)
    sender = WeightSender(
        [ServerRef("engine-0", server.url)],
        WeightSyncSettings(control_token=TEST_CONTROL_TOKEN, init_timeout_s=30, timeout_s=30),
    )
    try:
        before = _generate(server.url).json()["choices"][0]
        result = sender.push(iter_buckets(hf_models[1].named_parameters(), 64 << 10), version=1)
        (report,) = result.reports["engine-0"]  # the canary checked the engine process's weights
        assert report.params_loaded == report.params_total > 0
        after = _generate(server.url).json()["choices"][0]
        assert after["token_ids"] != before["token_ids"]
        assert after["weight_versions"] == [{"version": "1", "start": 0, "end": 12}]
        want = hf_token_logprobs(hf_models[1], PROMPT, after["token_ids"])
        got = torch.tensor([c["logprob"] for c in after["logprobs"]["content"]], dtype=torch.float64)
        assert (got - want).abs().max().item() < 1e-4
        control = {"Authorization": f"Bearer {TEST_CONTROL_TOKEN}"}
        assert httpx.get(server.url + "/weight_info", headers=control).json() == {"weight_version": "1"}

        # the engine process dies mid-request: that request, and any later one, fail with the reason.
        # The engine is paused first, so the request is still in the engine (queued) when it dies
        # however fast the machine is.
        assert httpx.post(server.url + "/pause", params={"mode": "keep"}, headers=control).status_code == 200
        result = {}
        worker = threading.Thread(target=lambda: result.update(r=_generate(server.url, max_tokens=480)))
        worker.start()
        wait_for_metric(server.url, "vllm:num_requests_waiting", lambda n: n >= 1)  # it reached the engine
        os.kill(_engine_pid(server), signal.SIGKILL)
        worker.join(30)
        response = result["r"]
        assert response.status_code == 500
        assert "engine process exited" in response.json()["error"]["message"]
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "not running" in health.text
        late = _generate(server.url)  # fails at once, not after a timeout
        assert late.status_code == 500 and "engine process exited" in late.text
    finally:
        sender.close()
        server.stop()


def test_an_engine_that_cannot_start_names_the_reason(tiny_qwen2_path):
    from refractor.inference.process import ServerStartError

    with pytest.raises(ServerStartError) as err:  # a KV budget below one block
        start_native_server(str(tiny_qwen2_path), engine_args=dict(ENGINE, kv_cache_memory_gb=1e-6))
    assert "the engine process could not start" in str(err.value)
