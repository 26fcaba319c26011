"""Prometheus metrics of the native server, under vLLM's ``vllm:`` names (one scraper reads both engines).

Histograms and counters are observed per finished request; scheduler gauges and token counters are
read from the engine's latest stats at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from refractor.inference.engine.async_engine import AsyncLLMEngine
from refractor.inference.engine.sequence import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class _EngineCollector:
    """Scheduler gauges and token counters, read from the engine's latest stats at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, labels: list[str]):
        self.engine = engine
        self.labels = labels

    def collect(self):
        s = self.engine.stats()
        names = ["model_name", "engine"]
        for cls, name, doc, value in (
            (
                GaugeMetricFamily,
                "vllm:num_requests_running",
                "Sequences in the running batch.",
                s.num_running,
            ),
            (
                GaugeMetricFamily,
                "vllm:num_requests_waiting",
                "Sequences waiting to be scheduled.",
                s.num_waiting,
            ),
            (
                GaugeMetricFamily,
                "vllm:kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (0-1).",
                s.kv_cache_usage,
            ),
            (CounterMetricFamily, "vllm:prompt_tokens", "Prefilled tokens.", s.prompt_tokens_total),
            (CounterMetricFamily, "vllm:generation_tokens", "Generated tokens.", s.generation_tokens_total),
            (
                CounterMetricFamily,
                "vllm:num_preemptions",
                "Sequences preempted (KV recomputed).",
                s.num_preemptions_total,
            ),
            (
                CounterMetricFamily,
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_cache_queries_total,
            ),
            (
                CounterMetricFamily,
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache (not recomputed).",
                s.prefix_cache_hits_total,
            ),
            (
                CounterMetricFamily,
                "refractor:engine_steps",
                "Engine steps (prefill or decode).",
                s.steps_total,
            ),
            (
                CounterMetricFamily,
                "refractor:engine_busy_seconds",
                "Wall time the engine thread spent in steps.",
                s.busy_seconds_total,
            ),
        ):
            family = cls(name, doc, labels=names)
            family.add_metric(self.labels, value)
            yield family
        # the engine's CUDA memory (nothing on CPU), read at scrape time
        for key, value in self.engine.memory_gb().items():
            family = GaugeMetricFamily(
                f"refractor:{key}", f"torch {key} of the engine's device.", labels=names
            )
            family.add_metric(self.labels, value)
            yield family


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.labels = [model_name, "0"]
        names = ["model_name", "engine"]
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to the first generated token.",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            "vllm:request_success",
            "Finished sequences by reason.",
            [*names, "finished_reason"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine, self.labels))

    def observe(self, output: RequestOutput) -> None:
        self.e2e.labels(*self.labels).observe(output.finish_time - output.arrival_time)
        if output.first_token_time is not None:
            self.ttft.labels(*self.labels).observe(output.first_token_time - output.arrival_time)
        for choice in output.outputs:
            self.finished.labels(*self.labels, choice.finish_reason).inc()
