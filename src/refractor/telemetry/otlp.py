"""An OTLP/HTTP trace receiver in the driver: each vLLM request's latency, from vLLM's own spans.

vLLM (``--otlp-traces-endpoint``) exports one ``llm_request`` span per finished request, batched
every ``OTEL_BSP_SCHEDULE_DELAY`` ms, with the request's id (``gen_ai.request.id``) and its latency
phases as attributes. :class:`OtlpTraceReceiver` accepts ``POST /v1/traces`` (protobuf, optionally
gzip; bodies are only ever parsed as protobuf) on a thread of its own and keeps, per request id, the
phases under the names the native engine returns (docs/metrics.md#latency); :meth:`take` hands one
request's latency to the orchestrator, waiting briefly for a span still on its way.

Memory is bounded whatever the senders do: at most ``max_entries`` requests, none older than
``max_age_s`` (the oldest go first), bodies over ``max_body_bytes`` (compressed or not) refused
with 413; a body that does not parse gets 400 and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from refractor.errors import RefractorUserError

log = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
REQUEST_ID_ATTRIBUTE = "gen_ai.request.id"
# vLLM's span attribute -> the name the native engine gives the same phase (seconds)
LATENCY_ATTRIBUTES = {
    "gen_ai.latency.time_in_queue": "queue_time",
    "gen_ai.latency.time_to_first_token": "ttft",
    "gen_ai.latency.time_in_model_prefill": "prefill_time",
    "gen_ai.latency.time_in_model_decode": "decode_time",
    "gen_ai.latency.time_in_model_inference": "inference_time",
    "gen_ai.latency.e2e": "e2e_latency",
}
MAX_ENTRIES = 10_000
MAX_AGE_S = 120.0
MAX_BODY_BYTES = 16 * 2**20
PROTOBUF = "application/x-protobuf"
SHUTDOWN_POLL_S = 0.1  # how soon ``stop`` is noticed by the serving thread


class OtlpReceiverError(RefractorUserError, OSError):
    """The receiver could not listen (the message names the keys to change)."""


def _number(value: AnyValue) -> float | None:
    kind = value.WhichOneof("value")
    if kind == "double_value":
        return value.double_value
    if kind == "int_value":
        return float(value.int_value)
    return None


def request_latencies(request: ExportTraceServiceRequest) -> Iterator[tuple[str, dict[str, float]]]:
    """``(request id, latency)`` of every span that names its request and has a latency phase."""
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                request_id = None
                latency = {}
                for attribute in span.attributes:
                    if attribute.key == REQUEST_ID_ATTRIBUTE and attribute.value.HasField("string_value"):
                        request_id = attribute.value.string_value
                    elif (name := LATENCY_ATTRIBUTES.get(attribute.key)) is not None:
                        number = _number(attribute.value)
                        if number is not None:
                            latency[name] = number
                if request_id and latency:
                    yield request_id, latency


class RequestLatencies:
    """Latency per request id, bounded in count and age, with waiters for ids not yet arrived.

    ``put`` may be called from any thread; ``take`` awaits on an event loop and is woken by the
    ``put`` of its id. Of a request's several spans (``n > 1``: every sample reports under the
    request's id), the first to arrive is the one taken."""

    def __init__(
        self,
        max_entries: int = MAX_ENTRIES,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[float, dict[str, float]]] = OrderedDict()  # oldest first
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def put(self, request_id: str, latency: dict[str, float]) -> None:
        with self._lock:
            waiter = self._waiters.pop(request_id, None)
            if waiter is None and request_id not in self._entries:
                self._entries[request_id] = (self.clock(), latency)
                self._evict()
        if waiter is not None:
            loop, future = waiter
            with contextlib.suppress(RuntimeError):  # the waiting loop has closed: nobody wants it
                loop.call_soon_threadsafe(_resolve, future, latency)

    def _evict(self) -> None:
        oldest_kept = self.clock() - self.max_age_s
        while self._entries and (
            len(self._entries) > self.max_entries or next(iter(self._entries.values()))[0] < oldest_kept
        ):
            self._entries.popitem(last=False)

    async def take(self, request_id: str, timeout_s: float) -> dict[str, float] | None:
        """The request's latency, removed from the store; None if it has not arrived within
        ``timeout_s`` (tracing off on that server, a lost batch: no latency, never an error)."""
        with self._lock:
            self._evict()
            entry = self._entries.pop(request_id, None)
            if entry is not None:
                return entry[1]
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            self._waiters[request_id] = (loop, future)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            return None
        finally:
            with self._lock:
                if self._waiters.get(request_id, (None, None))[1] is future:
                    del self._waiters[request_id]


def _resolve(future: asyncio.Future, latency: dict[str, float]) -> None:
    if not future.done():
        future.set_result(latency)


class _TraceHandler(BaseHTTPRequestHandler):
    server: _TraceServer
    protocol_version = "HTTP/1.1"  # keep-alive: the exporter posts every few hundred ms

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != TRACES_PATH:
            self._answer(404, b"not found")
            return
        if self.headers.get_content_type() != PROTOBUF:
            self._answer(415, b"only application/x-protobuf is accepted")
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._answer(411, b"Content-Length required")
            return
        limit = self.server.max_body_bytes
        if int(length) > limit:
            self._answer(413, b"request body too large")
            return
        body = self.rfile.read(int(length))
        encoding = self.headers.get("Content-Encoding", "identity").lower()
        if encoding == "gzip":
            inflate = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            try:
                body = inflate.decompress(body, limit + 1)
            except zlib.error:
                self._answer(400, b"bad gzip body")
                return
            if len(body) > limit:
                self._answer(413, b"request body too large once decompressed")
                return
        elif encoding != "identity":
            self._answer(415, b"unsupported Content-Encoding")
            return
        try:
            request = ExportTraceServiceRequest.FromString(body)
            latencies = list(request_latencies(request))
        except Exception:  # noqa: BLE001 - whatever a malformed body raises, it is the sender's fault
            self._answer(400, b"malformed ExportTraceServiceRequest")
            return
        for request_id, latency in latencies:
            self.server.latencies.put(request_id, latency)
        self._answer(200, ExportTraceServiceResponse().SerializeToString(), PROTOBUF)

    def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        if status >= 400:
            self.close_connection = True  # an unread rest of the body must not be taken as a request
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
        """Quiet: an exporter posts every few hundred ms."""


class _TraceServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], latencies: RequestLatencies, max_body_bytes: int) -> None:
        super().__init__(address, _TraceHandler)
        self.latencies = latencies
        self.max_body_bytes = max_body_bytes


class OtlpTraceReceiver:
    """``POST /v1/traces`` on ``host:port``, served from a daemon thread until :meth:`stop`.

    A busy ``port`` falls back to a free one (logged): two runs on one machine do not collide."""

    def __init__(
        self,
        host: str,
        port: int,
        latencies: RequestLatencies | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.latencies = latencies or RequestLatencies()
        try:
            self._server = _TraceServer((host, port), self.latencies, max_body_bytes)
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise OtlpReceiverError(
                    f"the OTLP trace receiver cannot listen on {host}:{port}: {err}; set "
                    "`otlp_receiver_port` to a port this machine can open, or `enable_vllm_tracing: false`"
                ) from None
            self._server = _TraceServer((host, 0), self.latencies, max_body_bytes)
            log.warning(
                "otlp_receiver_port %d is busy on %s; the OTLP trace receiver listens on port %d instead",
                port,
                host,
                self._server.server_address[1],
            )
        self.host = host
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            args=(SHUTDOWN_POLL_S,),
            name="refractor-otlp-receiver",
            daemon=True,
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The URL vLLM exports to (``--otlp-traces-endpoint``)."""
        return f"http://{self.host}:{self.port}{TRACES_PATH}"

    async def take(self, request_id: str, timeout_s: float) -> dict[str, float] | None:
        return await self.latencies.take(request_id, timeout_s)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)
