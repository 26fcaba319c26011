"""The native engine behind an HTTP server with vLLM 0.32's contract.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/inference/v1/generate``, ``/v1/models``,
``/tokenize`` (``routes_openai.py``); ``/health``, ``/metrics``, ``/pause``, ``/resume``,
``/is_paused``, ``/abort_requests`` (here); the weight-update routes
(``refractor.inference.weight_routes``), plus any ``extra_routers`` given to ``create_app``. Metrics keep vLLM's ``vllm:`` names so one
scraper reads both engines. Malformed bodies get a 400 naming the field; a client that disconnects
has its request aborted (KV freed at once).

Processes: ``refractor serve --engine native`` runs ``run_native_server`` in the foreground;
``start_native_server(...)`` starts that same command as a subprocess (its own session) and
returns a handle with ``.url`` and ``.stop()``, for Ray actors and tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from refractor.inference.engine.async_engine import PAUSE_MODES, AsyncLLMEngine, EngineDeadError
from refractor.inference.engine.sequence import RequestOutput
from refractor.inference.process import ServerProcess, client_host, free_port
from refractor.inference.protocol import AbortRequest
from refractor.inference.weight_routes import weight_update_router

log = logging.getLogger(__name__)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class _EngineCollector:
    """Scheduler gauges and token counters, read from the engine's latest stats at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, labels: list[str]):
        self.engine, self.labels = engine, labels

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


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    chat_template: str | None
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    active_request_ids: set[str] = field(default_factory=set)

    def matching_ids(self, external_ids: Iterable[str]) -> list[str]:
        """Engine request ids for vLLM-style external ids, or for the caller's bare ``request_id``."""
        found = []
        for rid in external_ids:
            for active in list(self.active_request_ids):
                if (
                    active == rid
                    or active in (f"chatcmpl-{rid}", f"generate-tokens-{rid}")
                    or active.startswith(f"cmpl-{rid}-")
                ):
                    found.append(active)
        return found


class BadRequest(ValueError):
    """A request the server refuses with 400 (also raised for unknown models: 404)."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.status = status


def error_response(message: str, status: HTTPStatus) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status.value, "InternalServerError")
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status.value}},
        status_code=status.value,
    )


async def run_until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


def create_app(
    engine: AsyncLLMEngine,
    tokenizer: Any,
    model_name: str,
    *,
    chat_template: str | None = None,
    extra_routers: Iterable[APIRouter] = (),
    include_weight_routes: bool = True,
) -> FastAPI:
    from refractor.inference.routes_openai import router as openai_router

    app = FastAPI(title="refractor native inference server")
    state = ServerState(
        engine,
        tokenizer,
        model_name,
        engine.engine.config.max_model_len,
        chat_template,
        ServerMetrics(engine, model_name),
    )
    app.state.refractor = state
    app.state.engine = engine  # what control routers (weight transfer) act on

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in exc.errors()
        )
        return error_response(f"invalid request: {problems}", HTTPStatus.BAD_REQUEST)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest):
        return error_response(str(exc), exc.status)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return error_response(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return error_response("the engine thread is not running", HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True) -> JSONResponse:
        # clear_cache is accepted for vLLM compatibility: there is no prefix cache to clear, and
        # update_weights recomputes the KV of in-flight requests itself.
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        await engine.pause(mode)
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume() -> JSONResponse:
        await engine.resume()
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": engine.is_paused})

    @app.post("/abort_requests")
    @app.post("/inference/v1/abort_requests")
    async def abort_requests(request: Request) -> JSONResponse:
        raw = await request.body()
        body = AbortRequest.model_validate_json(raw) if raw.strip() else AbortRequest()
        ids = None if not body.request_ids else state.matching_ids(body.request_ids)
        aborted = await engine.abort(ids) if ids is None or ids else 0
        return JSONResponse({"status": "aborted", "aborted": aborted})

    app.include_router(openai_router)
    routers = list(extra_routers)
    if include_weight_routes:
        routers.append(weight_update_router(engine))
    for extra in routers:
        app.include_router(extra)
    return app


# ---- processes ---------------------------------------------------------------------------------
def run_native_server(
    model: str,
    host: str = "0.0.0.0",
    port: int = 8000,
    *,
    engine_config=None,
    served_model_name: str | None = None,
    chat_template: str | None = None,
    log_level: str = "warning",
) -> None:
    """Load the model, start the engine thread and serve until SIGTERM/SIGINT (foreground)."""
    import uvicorn
    from transformers import AutoTokenizer

    from refractor.hub import resolve_model_path
    from refractor.inference.engine import EngineConfig, LLMEngine

    path = resolve_model_path(str(model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    core = LLMEngine.from_pretrained(path, engine_config or EngineConfig(), detokenize=tokenizer.decode)
    core.eos_token_ids |= eos
    engine = AsyncLLMEngine(core)
    app = create_app(engine, tokenizer, served_model_name or str(model), chat_template=chat_template)
    cfg = core.config
    print(
        f"refractor native server (pid {os.getpid()}): {path} on {core.device}, max_model_len {cfg.max_model_len}, "
        f"serving http://{host}:{port}",
        flush=True,
    )  # the first line of the server's log
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()


def start_native_server(
    model: str,
    host: str = "127.0.0.1",
    port: int | None = None,
    *,
    engine_args: dict[str, Any] | None = None,
    served_model_name: str | None = None,
    chat_template: str | None = None,
    env: dict[str, str] | None = None,
    startup_timeout_s: float = 180.0,
    log_path: str | None = None,
    die_with_parent: bool = False,
) -> ServerProcess:
    """Run ``refractor serve --engine native`` in a subprocess and wait for ``/health``.

    ``engine_args``: ``EngineConfig`` fields as CLI options (max_model_len, kv_cache_memory_gb,
    dtype, max_num_seqs, gpu_memory_utilization, enforce_eager, block_size, seed).
    """

    port = port or free_port(client_host(host))
    argv = [
        sys.executable,
        "-m",
        "refractor.cli",
        "serve",
        "--model",
        str(model),
        "--engine",
        "native",
        "--host",
        host,
        "--port",
        str(port),
    ]
    for key, value in (engine_args or {}).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif value is not None:
            argv += [flag, str(value)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if chat_template:
        argv += ["--chat-template", chat_template]
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="refractor-native-", suffix=".log")
        os.close(fd)
    server = ServerProcess.spawn(
        argv,
        url=f"http://{client_host(host)}:{port}",
        log_path=log_path,
        env=env,
        what=f"native server for {model}",
        die_with_parent=die_with_parent,
    )
    return server.wait_healthy(startup_timeout_s)
