"""Inference-server metrics scraped from each server's Prometheus ``/metrics``.

Every ``metrics_logger_interval_seconds`` the orchestrator reads every server's ``/metrics`` (vLLM's or
the native engine's, which uses vLLM's names) and stores one row per metric in the run store's
``system_metrics`` table with source ``inference:<server>``. Stored names (the table:
docs/metrics.md#inference-server-metrics): the ``vllm:`` prefix is dropped and the Prometheus names
are shortened (``num_requests_running`` -> ``requests_running``); histogram means are cumulative
since the server started (``_sum / _count``).

Two rates are derived from counter deltas between scrapes: ``generation_tokens_per_s`` (any engine)
and, for the native engine, ``engine_busy_fraction`` (the share of wall time its thread spent inside
engine steps) and ``engine_step_ms`` (mean step time). A busy fraction well below 1 while requests
wait means the engine is starved by its callers; near 1 with a low token rate means the steps
themselves are slow.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

GAUGES = {
    "num_requests_running": "requests_running",
    "num_requests_waiting": "requests_waiting",
    "kv_cache_usage_perc": "cache_usage",
    # native engine on a GPU: torch's memory of the engine's device
    "torch_allocated_gb": "torch_allocated_gb",
    "torch_reserved_gb": "torch_reserved_gb",
    "torch_max_allocated_gb": "torch_max_allocated_gb",
}
COUNTERS = {
    "request_success_total": "requests_total",
    "prompt_tokens_total": "prompt_tokens_total",
    "generation_tokens_total": "generation_tokens_total",
    "num_preemptions_total": "preemptions_total",
    "prefix_cache_hits_total": "cache_hits_total",
    "prefix_cache_queries_total": "cache_queries_total",
    "engine_steps_total": "engine_steps_total",
    "engine_busy_seconds_total": "engine_busy_seconds_total",
}
MEANS = {
    "time_to_first_token_seconds": "ttft_mean",
    "e2e_request_latency_seconds": "e2e_latency_mean",
    "inter_token_latency_seconds": "itl_mean",
    "request_queue_time_seconds": "queue_time_mean",
    "request_inference_time_seconds": "inference_time_mean",
    "request_prefill_time_seconds": "prefill_time_mean",
    "request_decode_time_seconds": "decode_time_mean",
    "iteration_tokens_total": "iteration_tokens_mean",
    "request_generation_tokens": "generation_tokens_per_request_mean",
    "request_prompt_tokens": "prompt_tokens_per_request_mean",
}


def _short(name: str) -> str:
    for prefix in ("vllm:", "refractor:"):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def server_metrics(samples: Mapping[str, float]) -> dict[str, float]:
    """Prometheus samples (summed over labels) -> the stored metric names; unknown names are left out."""
    short = {_short(name): value for name, value in samples.items() if not name.endswith("_bucket")}
    out = {GAUGES[k]: v for k, v in short.items() if k in GAUGES}
    out.update({COUNTERS[k]: v for k, v in short.items() if k in COUNTERS})
    for name, metric in MEANS.items():
        count = short.get(name + "_count")
        if count:
            out[metric] = short.get(name + "_sum", 0.0) / count
    return out


def rates(
    previous: Mapping[str, float] | None, current: Mapping[str, float], seconds: float
) -> dict[str, float]:
    """Rates from counter deltas between two scrapes ``seconds`` apart (empty on the first scrape or
    after a restart)."""
    if not previous or seconds <= 0:
        return {}
    delta = {k: current[k] - previous[k] for k in current.keys() & previous.keys() if k.endswith("_total")}
    if any(v < 0 for v in delta.values()):  # the server restarted: its counters began again
        return {}
    out = {}
    if "generation_tokens_total" in delta:
        out["generation_tokens_per_s"] = delta["generation_tokens_total"] / seconds
    if delta.get("cache_queries_total", 0.0) > 0:  # share of the prompt tokens the prefix cache held
        out["prefix_cache_hit_rate"] = delta.get("cache_hits_total", 0.0) / delta["cache_queries_total"]
    if "engine_busy_seconds_total" in delta:
        out["engine_busy_fraction"] = min(delta["engine_busy_seconds_total"] / seconds, 1.0)
        steps = delta.get("engine_steps_total", 0.0)
        if steps > 0:
            out["engine_step_ms"] = 1000.0 * delta["engine_busy_seconds_total"] / steps
    return out


class ServerMetricsScraper:
    """Scrapes every server each ``interval_s`` and hands ``(source, metrics, timestamp, node)`` to
    ``log_metrics`` (``nodes``: each server's node address, '' for a server not in it).

    ``servers``: objects with ``name`` and ``async metrics() -> {prometheus name: value}`` (the
    inference clients). A server that does not answer is skipped for that round (its heartbeat, not
    this loop, decides whether it is dead); the first failure per server is logged once.
    """

    def __init__(
        self,
        servers: Sequence[Any],
        log_metrics: Callable[[str, dict[str, float], float, str], None],
        interval_s: float,
        clock: Callable[[], float] = time.time,
        timeout_s: float | None = None,
        nodes: Mapping[str, str] | None = None,
    ):
        self.nodes = dict(nodes or {})
        self.servers = list(servers)
        self.log_metrics = log_metrics
        self.interval_s = interval_s
        self.clock = clock
        # generous: the answer waits behind the server's busy engine and this process's busy event
        # loop, and a late answer only delays the next scrape
        self.timeout_s = timeout_s if timeout_s is not None else max(interval_s, 5.0)
        self._last: dict[str, tuple[float, dict[str, float]]] = {}
        self._warned: set[str] = set()

    async def scrape_once(self) -> None:
        await asyncio.gather(*(self._scrape(server) for server in self.servers))

    async def _scrape(self, server: Any) -> None:
        try:
            samples = await asyncio.wait_for(server.metrics(), self.timeout_s)
        except Exception as err:  # noqa: BLE001 - telemetry never stops a run
            if server.name not in self._warned:
                self._warned.add(server.name)
                log.warning(
                    "metrics of %s could not be read (%r); skipping it until it answers", server.name, err
                )
            return
        now = self.clock()
        metrics = server_metrics(samples)
        previous = self._last.get(server.name)
        metrics.update(
            rates(previous[1] if previous else None, metrics, now - previous[0] if previous else 0.0)
        )
        self._last[server.name] = (now, metrics)
        if metrics:
            self.log_metrics(f"inference:{server.name}", metrics, now, self.nodes.get(server.name, ""))

    async def run(self) -> None:
        while True:  # a first scrape at once: the rates need two
            await self.scrape_once()
            await asyncio.sleep(self.interval_s)
