"""The native engine behind an HTTP server with vLLM 0.32's contract.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/inference/v1/generate``, ``/v1/models``,
``/tokenize`` (``routes_openai.py``); ``/health``, ``/metrics``, ``/pause``, ``/resume``,
``/is_paused``, ``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/abort_requests`` (here), all sharing
one ``ServerState`` (``server_state.py``); the weight-update routes
(``refractor.inference.weight_routes``), plus any ``extra_routers`` given to ``create_app``.
Metrics keep vLLM's ``vllm:`` names so one scraper reads both engines (``server_metrics.py``).
Malformed bodies get a 400 naming the field; a client that disconnects has its request aborted (KV
freed at once).

Access (``refractor.inference.access``): the control routes (pause, resume, abort, weight updates)
exist only on a server given a control token and need it on every call; an API key, when set,
guards the generation routes; the API docs are off unless asked for.

Processes: ``refractor serve --engine native`` runs ``run_native_server`` in the foreground;
``refractor.inference.native_launcher.start_native_server(...)`` starts that same command as a
subprocess (its own session) and returns a handle with ``.url`` and ``.stop()``, for Ray actors and
tests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

import psutil
import torch
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from refractor.inference.access import AccessGuard
from refractor.inference.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, BodyLimit
from refractor.inference.engine.async_engine import (
    PAUSE_MODES,
    AsyncLLMEngine,
    EngineDeadError,
    RequestFailedError,
)
from refractor.inference.engine.llm_engine import SleepModeOffError
from refractor.inference.engine_core import load_engine
from refractor.inference.engine_process import EngineProcessClient, RemoteWeightTransfer
from refractor.inference.keepalive import SERVER_KEEPALIVE_S
from refractor.inference.request_schemas import AbortRequest
from refractor.inference.routes_openai import router as openai_router
from refractor.inference.server_metrics import ServerMetrics
from refractor.inference.server_state import BadRequest, ServerState, error_response, invalid_request
from refractor.inference.weight_routes import WeightTransfer, weight_update_router

log = logging.getLogger(__name__)


def create_app(
    engine: AsyncLLMEngine | EngineProcessClient,
    tokenizer: Any,
    model_name: str,
    *,
    chat_template: str | None = None,
    control_token: str | None = None,
    api_key: str | None = None,
    enable_docs: bool = False,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    extra_routers: Iterable[APIRouter] = (),
    weight_transfer: WeightTransfer | RemoteWeightTransfer | None = None,
) -> FastAPI:
    """The server's app. ``control_token=None``: no control routes (a plain serving endpoint).
    ``engine``: the engine thread in this process, or the client of an engine process.
    ``weight_transfer``: what the weight routes act on (default: ``WeightTransfer(engine)``, here;
    an engine process's ``weight_transfer()`` forwards them to it)."""
    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.connect()  # an engine process's messages are read from the first moment on
        yield

    app = FastAPI(title="refractor native inference server", lifespan=lifespan, **docs)
    app.add_middleware(BodyLimit, max_bytes=max_request_body_bytes)
    app.add_middleware(AccessGuard, control_token=control_token, api_key=api_key)
    state = ServerState(
        engine,
        tokenizer,
        model_name,
        engine.max_model_len,
        chat_template,
        ServerMetrics(engine, model_name),
    )
    app.state.refractor = state
    app.state.engine = engine  # what control routers (weight transfer) act on

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(invalid_request(exc.errors()), HTTPStatus.BAD_REQUEST)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest):
        return error_response(str(exc), exc.status)

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(RequestFailedError)
    async def _failed_in_engine(request: Request, exc: EngineDeadError | RequestFailedError):
        return error_response(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return error_response("the engine is not running", HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(openai_router)
    if control_token is not None:
        app.include_router(_control_router(engine, state))
        app.include_router(weight_update_router(weight_transfer or WeightTransfer(engine)))
    for extra in extra_routers:
        app.include_router(extra)
    return app


def _control_router(engine: AsyncLLMEngine | EngineProcessClient, state: ServerState) -> APIRouter:
    """/pause, /resume, /is_paused, /sleep, /wake_up, /is_sleeping, /abort_requests: mounted only on
    servers with a control token."""
    router = APIRouter()

    @router.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True) -> JSONResponse:
        # clear_cache is accepted for vLLM compatibility: there is no prefix cache to clear, and
        # update_weights recomputes the KV of in-flight requests itself.
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        await engine.pause(mode)
        return JSONResponse({"status": "paused"})

    @router.post("/resume")
    async def resume() -> JSONResponse:
        await engine.resume()
        return JSONResponse({"status": "resumed"})

    @router.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": engine.is_paused})

    @router.post("/sleep")
    async def sleep(level: int = 1, mode: str = "abort") -> JSONResponse:
        try:
            await engine.sleep(level, mode)
        except (ValueError, SleepModeOffError) as err:
            raise BadRequest(str(err)) from None
        return JSONResponse({"status": "sleeping", "level": level})

    @router.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)) -> JSONResponse:
        try:
            awake = await engine.wake_up(tags or None)
        except (ValueError, SleepModeOffError) as err:
            raise BadRequest(str(err)) from None
        except torch.OutOfMemoryError as err:  # the memory is taken: the caller may free some and retry
            raise BadRequest(str(err), HTTPStatus.SERVICE_UNAVAILABLE) from None
        return JSONResponse({"status": "awake" if awake else "sleeping", "tags": tags or None})

    @router.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": engine.is_sleeping})

    @router.post("/abort_requests")
    @router.post("/inference/v1/abort_requests")
    async def abort_requests(request: Request) -> JSONResponse:
        raw = await request.body()
        try:
            body = AbortRequest.model_validate_json(raw) if raw.strip() else AbortRequest()
        except ValidationError as err:
            raise BadRequest(invalid_request(err.errors())) from None
        ids = None if not body.request_ids else state.matching_ids(body.request_ids)
        aborted = await engine.abort(ids) if ids is None or ids else 0
        return JSONResponse({"status": "aborted", "aborted": aborted})

    return router


# ---- processes ---------------------------------------------------------------------------------
def run_native_server(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    engine_config=None,
    served_model_name: str | None = None,
    chat_template: str | None = None,
    control_token: str | None = None,
    api_key: str | None = None,
    enable_docs: bool = False,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    timeout_keep_alive_s: int = SERVER_KEEPALIVE_S,
    log_level: str = "warning",
    engine_process: bool = False,
) -> None:
    """Load the model, start the engine (a thread here, or with ``engine_process`` a process of its
    own) and serve until SIGTERM/SIGINT (foreground)."""
    import uvicorn
    from transformers import AutoTokenizer

    from refractor.hub import resolve_model_path
    from refractor.inference.engine import EngineConfig

    path = resolve_model_path(str(model))
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer_s = time.perf_counter() - started
    config = engine_config or EngineConfig()
    if engine_process:
        engine = EngineProcessClient.start(str(path), config, log_level=log_level)
        device, startup_s = engine.info.device, engine.info.startup_s
        where = f"engine process {engine.info.pid}"
    else:
        core = load_engine(path, config, tokenizer)
        engine = AsyncLLMEngine(core)
        device, startup_s, where = core.device, core.runner.startup_s, "engine thread"
    engine_s = time.perf_counter() - started - tokenizer_s
    app = create_app(
        engine,
        tokenizer,
        served_model_name or str(model),
        chat_template=chat_template,
        control_token=control_token,
        api_key=api_key,
        enable_docs=enable_docs,
        max_request_body_bytes=max_request_body_bytes,
        weight_transfer=engine.weight_transfer() if engine_process else None,
    )
    lora = (
        f"runtime LoRA adapters of rank {config.lora_rank} on {','.join(config.lora_target_modules)}, "
        if config.lora_rank
        else ""
    )
    print(
        f"refractor native server (pid {os.getpid()}, {where}): {path} on {device}, "
        f"max_model_len {engine.max_model_len}, {lora}"
        f"serving http://{host}:{port}",
        flush=True,
    )  # the first line of the server's log
    since_start = time.time() - psutil.Process().create_time()
    phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in startup_s.items())
    print(
        f"started in {since_start:.1f} s: imports {since_start - tokenizer_s - engine_s:.1f} s, "
        f"tokenizer {tokenizer_s:.1f} s, engine {engine_s:.1f} s ({phases})",
        flush=True,
    )
    try:
        uvicorn.run(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=timeout_keep_alive_s,  # outlives the clients' idle connections
        )
    finally:
        engine.shutdown()
