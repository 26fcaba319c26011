"""The OTLP/HTTP trace receiver: real protobuf requests (built with ``opentelemetry.proto``, and sent
by the OpenTelemetry SDK's own exporter, the one vLLM uses) become each request's latency; bad,
oversized or unknown input is refused and changes nothing; memory stays bounded."""

from __future__ import annotations

import asyncio
import gzip
import logging
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("opentelemetry.proto")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue  # noqa: E402
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span  # noqa: E402

from refractor.telemetry.otlp import OtlpTraceReceiver, RequestLatencies  # noqa: E402

VLLM_ATTRIBUTES = {
    "gen_ai.latency.time_in_queue": 0.25,
    "gen_ai.latency.time_to_first_token": 0.5,
    "gen_ai.latency.time_in_model_prefill": 0.125,
    "gen_ai.latency.time_in_model_decode": 1.5,
    "gen_ai.latency.time_in_model_inference": 1.625,
    "gen_ai.latency.e2e": 2,  # an int value is a number too
    "gen_ai.usage.prompt_tokens": 7,
}
EXPECTED = {
    "queue_time": 0.25,
    "ttft": 0.5,
    "prefill_time": 0.125,
    "decode_time": 1.5,
    "inference_time": 1.625,
    "e2e_latency": 2.0,
}
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def value(v) -> AnyValue:
    if isinstance(v, str):
        return AnyValue(string_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    return AnyValue(double_value=v)


def span(request_id: str | None, attributes: dict | None = None) -> Span:
    attrs = dict(VLLM_ATTRIBUTES if attributes is None else attributes)
    if request_id is not None:
        attrs["gen_ai.request.id"] = request_id
    return Span(name="llm_request", attributes=[KeyValue(key=k, value=value(v)) for k, v in attrs.items()])


def export(*spans: Span) -> bytes:
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])])
    return request.SerializeToString()


def take(receiver, request_id: str, timeout_s: float = 0.0):
    return asyncio.run(receiver.take(request_id, timeout_s))


@pytest.fixture
def receiver():
    r = OtlpTraceReceiver("127.0.0.1", 0, max_body_bytes=4096)
    yield r
    r.stop()


def test_spans_become_latency_under_the_native_engine_names(receiver):
    body = export(
        span("generate-tokens-a"),
        span(None),  # no request id: not a request's span
        span("generate-tokens-b", {"code.function": "load_model"}),  # no latency phase
    )
    answer = httpx.post(receiver.endpoint, content=body, headers=PROTOBUF)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/x-protobuf"
    assert ExportTraceServiceResponse.FromString(answer.content) == ExportTraceServiceResponse()
    assert take(receiver, "generate-tokens-a") == EXPECTED
    assert len(receiver.latencies) == 0  # taken once; the other spans were never kept
    compressed = gzip.compress(export(span("generate-tokens-c", {"gen_ai.latency.e2e": 0.75})))
    answer = httpx.post(
        receiver.endpoint, content=compressed, headers={**PROTOBUF, "Content-Encoding": "gzip"}
    )
    assert answer.status_code == 200 and take(receiver, "generate-tokens-c") == {"e2e_latency": 0.75}


def test_bad_oversized_or_foreign_bodies_are_refused_and_change_nothing(receiver):
    def post(content: bytes, path: str = "/v1/traces", **headers) -> int:
        url = receiver.endpoint.replace("/v1/traces", path)
        return httpx.post(url, content=content, headers={**PROTOBUF, **headers}).status_code

    assert post(b"\xff\xff\xff not protobuf") == 400
    assert post(b"not gzip", **{"Content-Encoding": "gzip"}) == 400
    assert post(export(span("x")), **{"Content-Type": "application/json"}) == 415
    assert post(export(span("x")), path="/v1/metrics") == 404
    assert post(b"\0" * 5000) == 413  # over the receiver's 4096 bytes
    # small on the wire, large once inflated: refused without inflating it all
    assert post(gzip.compress(b"\0" * 10**6), **{"Content-Encoding": "gzip"}) == 413
    assert len(receiver.latencies) == 0
    assert post(export(span("after"))) == 200  # the receiver still serves
    assert take(receiver, "after") == EXPECTED


def test_the_sdk_exporter_that_vllm_uses_reaches_the_receiver(receiver):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint)))
    attributes = {**VLLM_ATTRIBUTES, "gen_ai.latency.e2e": 2.0, "gen_ai.request.id": "generate-tokens-sdk"}
    provider.get_tracer("test").start_span("llm_request", attributes=attributes).end()
    provider.shutdown()
    assert take(receiver, "generate-tokens-sdk") == EXPECTED


def test_a_lookup_waits_for_a_late_span_and_a_missing_one_is_none_quickly(receiver):
    def late_post():
        time.sleep(0.2)
        httpx.post(receiver.endpoint, content=export(span("late")), headers=PROTOBUF)

    poster = threading.Thread(target=late_post)
    poster.start()
    began = time.monotonic()
    assert take(receiver, "late", timeout_s=5.0) == EXPECTED
    assert time.monotonic() - began < 2.0  # woken by the span, not by the timeout
    poster.join()
    began = time.monotonic()
    assert take(receiver, "never-sent", timeout_s=0.1) is None
    assert time.monotonic() - began < 0.5


def test_memory_is_bounded_by_count_and_age():
    now = [0.0]
    store = RequestLatencies(max_entries=3, max_age_s=10.0, clock=lambda: now[0])
    for i in range(5):
        store.put(f"r{i}", {"e2e_latency": float(i)})
    assert len(store) == 3  # the two oldest went
    assert asyncio.run(store.take("r0", 0.0)) is None
    assert asyncio.run(store.take("r4", 0.0)) == {"e2e_latency": 4.0}
    now[0] = 5.0
    store.put("r5", {"e2e_latency": 5.0})
    now[0] = 12.0  # r2, r3 (t=0) are now older than 10 s; r5 (t=5) is not
    assert asyncio.run(store.take("r3", 0.0)) is None
    assert len(store) == 1 and asyncio.run(store.take("r5", 0.0)) == {"e2e_latency": 5.0}


def test_a_busy_port_falls_back_to_a_free_one(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="refractor.telemetry.otlp"):
            receiver = OtlpTraceReceiver("127.0.0.1", busy)
        try:
            assert receiver.port != busy and f"otlp_receiver_port {busy} is busy" in caplog.text
            answer = httpx.post(receiver.endpoint, content=export(span("moved")), headers=PROTOBUF)
            assert answer.status_code == 200 and take(receiver, "moved") == EXPECTED
        finally:
            receiver.stop()


def test_the_driver_starts_a_receiver_for_vllm_with_tracing_only():
    from ray.util import get_node_ip_address

    from refractor.config import load_config
    from refractor.train import start_trace_receiver

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cfg = load_config(None, {"environments": [{"name": "countdown"}], "otlp_receiver_port": port})
    assert start_trace_receiver(cfg, "native", single_node=True) is None  # it answers with latency itself
    off = cfg.model_copy(update={"enable_vllm_tracing": False})
    assert start_trace_receiver(off, "vllm", single_node=True) is None
    for single_node, host in ((True, "127.0.0.1"), (False, get_node_ip_address())):
        receiver = start_trace_receiver(cfg, "vllm", single_node=single_node)
        try:  # loopback on one node; the driver node's address, which other nodes reach, else
            assert receiver.endpoint == f"http://{host}:{port}/v1/traces"
        finally:
            receiver.stop()
