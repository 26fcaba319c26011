"""Inference-server metrics: Prometheus names -> the stored names (docs/metrics.md#inference-server-metrics),
counter rates, and a real scrape of the native server (its engine thread's busy fraction agrees with
the time the test kept it decoding)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from refractor.inference.client import InferenceClient, InferenceServerError
from refractor.inference.native_launcher import start_native_server
from refractor.telemetry.server_metrics import ServerMetricsScraper, rates, server_metrics


def test_prometheus_names_become_the_stored_names():
    samples = {
        "vllm:num_requests_running": 3.0,
        "vllm:num_requests_waiting": 1.0,
        "vllm:kv_cache_usage_perc": 0.25,
        "vllm:request_success_total": 7.0,
        "vllm:generation_tokens_total": 700.0,
        "vllm:prompt_tokens_total": 90.0,
        "vllm:num_preemptions_total": 2.0,
        "vllm:time_to_first_token_seconds_sum": 1.5,
        "vllm:time_to_first_token_seconds_count": 6.0,
        "vllm:time_to_first_token_seconds_bucket": 99.0,
        "vllm:e2e_request_latency_seconds_count": 0.0,
        "vllm:e2e_request_latency_seconds_sum": 0.0,
        "refractor:engine_busy_seconds_total": 4.0,
        "refractor:engine_steps_total": 200.0,
        "process_cpu_seconds_total": 12.0,  # not an inference metric: left out
    }
    assert server_metrics(samples) == {
        "requests_running": 3.0,
        "requests_waiting": 1.0,
        "cache_usage": 0.25,
        "requests_total": 7.0,
        "generation_tokens_total": 700.0,
        "prompt_tokens_total": 90.0,
        "preemptions_total": 2.0,
        "ttft_mean": 0.25,
        "engine_busy_seconds_total": 4.0,
        "engine_steps_total": 200.0,
    }  # no mean of 0 samples


def test_rates_come_from_counter_deltas():
    before = {
        "generation_tokens_total": 100.0,
        "engine_busy_seconds_total": 1.0,
        "engine_steps_total": 10.0,
        "cache_queries_total": 1000.0,
        "cache_hits_total": 200.0,
    }
    after = {
        "generation_tokens_total": 500.0,
        "engine_busy_seconds_total": 2.5,
        "engine_steps_total": 310.0,
        "cache_queries_total": 3000.0,
        "cache_hits_total": 1700.0,
        "requests_running": 4.0,
    }
    assert rates(before, after, 2.0) == pytest.approx(
        {
            "generation_tokens_per_s": 200.0,
            "engine_busy_fraction": 0.75,
            "engine_step_ms": 5.0,
            "prefix_cache_hit_rate": 0.75,
        }
    )
    assert rates(None, after, 2.0) == {}  # the first scrape has nothing to compare with
    assert rates(after, before, 2.0) == {}  # counters went down: the server restarted


class _Unreachable:
    name = "server-9"

    async def metrics(self):
        raise InferenceServerError("inference server http://127.0.0.1:9 unreachable after 4 attempts")


def test_a_real_native_server_is_scraped_and_a_dead_one_is_skipped(tiny_qwen2_path, caplog):
    server = start_native_server(
        str(tiny_qwen2_path), engine_args={"max_model_len": 512, "kv_cache_memory_gb": 0.05}
    )
    rows: list[tuple[str, dict, float, str]] = []
    try:

        async def scrape() -> None:
            async with InferenceClient(server.url, name="server-0") as client:
                scraper = ServerMetricsScraper(
                    [client, _Unreachable()],
                    lambda *row: rows.append(row),
                    0.5,
                    nodes={"server-0": "10.0.0.7"},
                )
                await scraper.scrape_once()  # idle
                body = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "n": 4}
                request = threading.Thread(
                    target=lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=60)
                )
                request.start()
                # scrape while it decodes, often: a fast machine decodes it in well under a second
                while request.is_alive():
                    await asyncio.sleep(0.05)
                    await scraper.scrape_once()
                request.join()
                await scraper.scrape_once()

        started = time.time()
        asyncio.run(scrape())
    finally:
        server.stop()
    # server-9 skipped, the loop went on; rows carry the node the server runs on
    assert {(source, node) for source, _, _, node in rows} == {("inference:server-0", "10.0.0.7")}
    assert "server-9" in caplog.text and caplog.text.count("server-9") == 1  # warned once
    assert all(started <= ts <= time.time() for _, _, ts, _ in rows)
    first = rows[0][1]
    last = rows[-1][1]
    assert first["requests_running"] == 0 and "engine_busy_fraction" not in first
    assert last["generation_tokens_total"] - first["generation_tokens_total"] == 1600
    assert last["requests_total"] - first.get("requests_total", 0.0) == 4
    # 4 samples of a 3-token prompt: 12 prompt tokens looked up, none in a full block to share
    assert last["cache_queries_total"] - first["cache_queries_total"] == 12 and last["cache_hits_total"] == 0
    busy = [m for _, m, _, _ in rows[1:-1] if m.get("requests_running") == 4]
    assert busy, "no scrape saw the request decoding"
    # while 4 sequences decode the engine thread steps without pause: busy nearly all the time
    assert max(m["engine_busy_fraction"] for m in busy) > 0.5
    assert all(m["generation_tokens_per_s"] > 0 and m["engine_step_ms"] > 0 for m in busy)
