"""The native engine in a process of its own, driven by the HTTP server over ZeroMQ.

Why: in one process the engine thread and the server's event loop share one GIL. Every millisecond
the event loop spends on HTTP parsing, validation and response building is a millisecond the
engine thread cannot launch its next step, and the engine's step is mostly Python between kernel
launches. Split, the engine process runs only the engine thread and a thin message loop, and the
server process keeps HTTP, tokenization and chat templates.

Layout (``refractor serve --engine-process``):

- the server process (``EngineProcessClient``): the FastAPI app; binds two ZeroMQ sockets on
  ``ipc://`` paths in a private temporary directory (mode 0700: only this user can connect);
- the engine process (``engine_main``): loads the model, wraps it in ``AsyncLLMEngine``, connects
  to both sockets and serves requests, control calls and the weight-update routes
  (``WeightTransfer`` runs here, where the weights are: NCCL groups and CUDA IPC handles belong to
  this process).

Messages are msgpack lists (never pickle), server -> engine:
``["generate", rid, prompt_ids, params, priority]``, ``["cancel", rid]``,
``["call", call_id, op, args]``; engine -> server: ``["ready", info]``, ``["failed", message]``,
``["output", rid, output, status]``, ``["request_error", rid, kind, message]``,
``["reply", call_id, result, status]``, ``["call_error", call_id, kind, message, http_status]``,
``["status", status]`` (every ``STATUS_INTERVAL_S``: the engine's counters for ``/metrics``).

Failure: an engine process that dies fails every request in flight with ``EngineDeadError`` and
``/health`` answers 503; an engine process whose server dies exits within a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict
from http import HTTPStatus
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from refractor.inference.engine.async_engine import EngineDeadError, RequestFailedError
from refractor.inference.engine.llm_engine import EngineStats, SleepModeOffError
from refractor.inference.engine.sampling_params import SamplingParams
from refractor.inference.engine.sequence import CompletionOutput, RequestOutput, WeightVersionSpan

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 0.25
PARENT_CHECK_S = 1.0


# ---- wire format -------------------------------------------------------------------------------
def _pack(message: list) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def _unpack(frame: bytes) -> list:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


def encode_output(out: RequestOutput) -> list:
    completions = [
        [
            c.index,
            c.token_ids,
            c.logprobs,
            c.finish_reason,
            c.stop_reason,
            [[s.version, s.start, s.end] for s in c.weight_versions],
            c.ranks,
            c.top_logprobs,
        ]
        for c in out.outputs
    ]
    return [
        out.request_id,
        out.prompt_token_ids,
        completions,
        out.arrival_time,
        out.first_token_time,
        out.finish_time,
        out.error,
        out.scheduled_time,
    ]


def decode_output(fields: list) -> RequestOutput:
    rid, prompt, completions, arrival, first_token, finish, error, scheduled = fields
    outputs = [
        CompletionOutput(
            index,
            token_ids,
            logprobs,
            finish_reason,
            stop_reason,
            [WeightVersionSpan(*span) for span in spans],
            ranks,
            [[tuple(pair) for pair in position] for position in top],
        )
        for index, token_ids, logprobs, finish_reason, stop_reason, spans, ranks, top in completions
    ]
    return RequestOutput(rid, prompt, outputs, arrival, first_token, finish, error, scheduled)


def _error_fields(err: BaseException) -> tuple[str, str, int]:
    """(kind, message, HTTP status) of an exception raised where the engine is."""
    from fastapi import HTTPException

    from refractor.inference.server_state import BadRequest

    if isinstance(err, BadRequest):
        return "BadRequest", str(err), int(err.status)
    if isinstance(err, HTTPException):
        return "HTTPException", str(err.detail), err.status_code
    return type(err).__name__, str(err), int(HTTPStatus.INTERNAL_SERVER_ERROR)


def _rebuild_error(kind: str, message: str, status: int = 500) -> BaseException:
    """The server-side exception of the same type, so routes handle it as they would in-process."""
    import torch
    from fastapi import HTTPException

    from refractor.inference.server_state import BadRequest

    if kind == "BadRequest":
        return BadRequest(message, HTTPStatus(status))
    if kind == "HTTPException":
        return HTTPException(status, message)
    known = {
        "ValueError": ValueError,
        "EngineDeadError": EngineDeadError,
        "RequestFailedError": RequestFailedError,
        "SleepModeOffError": SleepModeOffError,
        "OutOfMemoryError": torch.OutOfMemoryError,
    }
    cls = known.get(kind)
    return cls(message) if cls else RuntimeError(f"{kind} in the engine process: {message}")


# ---- the server's side -------------------------------------------------------------------------
class EngineProcessClient:
    """``AsyncLLMEngine``'s interface, for an engine that runs in its own process.

    ``start`` is called before the server's event loop exists; the asyncio sockets and the reader
    task are made on first use inside the loop.
    """

    def __init__(
        self,
        proc: multiprocessing.Process,
        workdir: str,
        info: dict,
        ctx: zmq.Context,
        sockets: tuple[zmq.Socket, zmq.Socket],
    ) -> None:
        self._proc = proc
        self._workdir = workdir
        self.info = info
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self._status: dict = info["status"]
        self._ctx = ctx
        self._sockets = sockets  # (push, pull), bound before the engine process started
        self._push: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._requests: dict[str, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._dead: str | None = None

    @classmethod
    def start(
        cls, model_path: str, config: Any, *, log_level: str = "WARNING", startup_timeout_s: float = 3600.0
    ) -> EngineProcessClient:
        """Spawn the engine process and wait until its engine is built (or it failed)."""
        workdir = tempfile.mkdtemp(prefix="refractor-engine-")  # 0700: the sockets are this user's
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.bind(f"ipc://{workdir}/in")
        pull = ctx.socket(zmq.PULL)
        pull.bind(f"ipc://{workdir}/out")
        spawn = multiprocessing.get_context("spawn")
        proc = spawn.Process(
            target=engine_main,
            args=(model_path, config, f"ipc://{workdir}/in", f"ipc://{workdir}/out", os.getpid(), log_level),
            name="refractor-engine-process",
        )
        proc.start()
        try:
            deadline = time.monotonic() + startup_timeout_s
            while True:
                if pull.poll(500):
                    message = _unpack(pull.recv())
                    if message[0] == "ready":
                        return cls(proc, workdir, message[1], ctx, (push, pull))
                    if message[0] == "failed":
                        raise RuntimeError(f"the engine process could not start: {message[1]}")
                if not proc.is_alive():
                    raise RuntimeError(
                        f"the engine process exited with code {proc.exitcode} before its engine was "
                        "ready (its log is above)"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the engine process was not ready within {startup_timeout_s:.0f} s")
        except BaseException:
            _stop_process(proc)
            ctx.destroy(linger=0)
            shutil.rmtree(workdir, ignore_errors=True)
            raise

    async def connect(self) -> None:
        """Start reading the engine's messages on the running loop (the server's startup)."""
        await self._connected()

    async def _connected(self) -> zmq.asyncio.Socket:
        if self._push is None:  # the sockets bound at start, now driven by this loop
            self._push = zmq.asyncio.Socket.from_socket(self._sockets[0])
            self._reader = asyncio.create_task(self._read(zmq.asyncio.Socket.from_socket(self._sockets[1])))
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        return self._push

    async def _read(self, pull: zmq.asyncio.Socket) -> None:
        try:
            while self._dead is None:
                if not await pull.poll(1000):
                    if not self._proc.is_alive():
                        self._fail_all(f"the engine process exited with code {self._proc.exitcode}")
                    continue
                self._dispatch(_unpack(await pull.recv()))
        except Exception as err:  # noqa: BLE001 - without its reader every waiting request would hang
            log.exception("reading the engine process's messages failed")
            self._fail_all(f"the server lost its link to the engine process: {type(err).__name__}: {err}")

    def _dispatch(self, message: list) -> None:
        kind = message[0]
        if kind == "output":  # with the status after it: /metrics counts this request at once
            self._status.update(message[3])
            _settle(self._requests.pop(message[1], None), decode_output(message[2]))
        elif kind == "request_error":
            _settle(self._requests.pop(message[1], None), error=_rebuild_error(message[2], message[3]))
        elif kind == "reply":
            self._status.update(message[3])
            _settle(self._calls.pop(message[1], None), message[2])
        elif kind == "call_error":
            self._status.update(message[5])
            _settle(self._calls.pop(message[1], None), error=_rebuild_error(*message[2:5]))
        elif kind == "status":
            self._status.update(message[1])

    def _fail_all(self, reason: str) -> None:
        self._dead = reason
        log.error("%s; failing %d requests in flight", reason, len(self._requests) + len(self._calls))
        for future in [*self._requests.values(), *self._calls.values()]:
            _settle(future, error=EngineDeadError(reason))
        self._requests.clear()
        self._calls.clear()

    async def call(self, op: str, **args: Any) -> Any:
        push = await self._connected()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        await push.send(_pack(["call", call_id, op, args]))
        return await future

    # ---- AsyncLLMEngine's interface ------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> RequestOutput:
        push = await self._connected()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        future = asyncio.get_running_loop().create_future()
        self._requests[request_id] = future
        await push.send(_pack(["generate", request_id, list(prompt_token_ids), asdict(params), priority]))
        try:
            return await future
        except asyncio.CancelledError:
            if self._requests.pop(request_id, None) is not None and self._dead is None:
                push.send(_pack(["cancel", request_id]))  # queued at once; nobody waits for it
            raise

    async def abort(self, request_ids: list[str] | None = None) -> int:
        return await self.call("abort", request_ids=request_ids)

    async def pause(self, mode: str = "abort") -> None:
        await self.call("pause", mode=mode)

    async def resume(self) -> None:
        await self.call("resume")

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        await self.call("sleep", level=level, mode=mode)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return await self.call("wake_up", tags=tags)

    @property
    def is_paused(self) -> bool:
        return self._status["is_paused"]

    @property
    def is_sleeping(self) -> bool:
        return self._status["is_sleeping"]

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._proc.is_alive()

    def stats(self) -> EngineStats:
        return EngineStats(**self._status["stats"])

    def memory_gb(self) -> dict[str, float]:
        return self._status["memory_gb"]

    def weight_transfer(self) -> RemoteWeightTransfer:
        return RemoteWeightTransfer(self)

    def shutdown(self) -> None:
        _stop_process(self._proc)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._workdir, ignore_errors=True)


class RemoteWeightTransfer:
    """``WeightTransfer``'s methods, run in the engine process."""

    def __init__(self, client: EngineProcessClient) -> None:
        self.client = client

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> dict:
        return await self.client.call("reset_prefix_cache", reset_running_requests=reset_running_requests)

    async def weight_info(self) -> dict:
        return await self.client.call("weight_info")

    async def init(self, info) -> dict:
        return await self.client.call("init", info=info.model_dump())

    async def shutdown(self) -> dict:
        return await self.client.call("shutdown")

    async def start(self) -> dict:
        return await self.client.call("start")

    async def update(self, body: bytes) -> dict:
        return await self.client.call("update", body=body)

    async def finish(self, weight_version: str | None) -> dict:
        return await self.client.call("finish", weight_version=weight_version)


def _settle(future: asyncio.Future | None, result: Any = None, error: BaseException | None = None) -> None:
    if future is None or future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _stop_process(proc: multiprocessing.Process) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


# ---- the engine's side -------------------------------------------------------------------------
def engine_main(
    model_path: str, config: Any, inbox: str, outbox: str, parent_pid: int, log_level: str = "WARNING"
) -> None:
    """The engine process: build the engine, then serve the server's messages until it goes away."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(outbox)
    try:
        asyncio.run(_serve(model_path, config, ctx, push, inbox, parent_pid))
    finally:
        ctx.destroy(linger=1000)


async def _serve(
    model_path: str,
    config: Any,
    ctx: zmq.asyncio.Context,
    push: zmq.asyncio.Socket,
    inbox: str,
    parent_pid: int,
) -> None:
    try:
        from transformers import AutoTokenizer

        from refractor.inference.engine import LLMEngine
        from refractor.inference.engine.async_engine import AsyncLLMEngine
        from refractor.inference.request_schemas import InitInfo
        from refractor.inference.weight_routes import WeightTransfer

        started = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        core = LLMEngine.from_pretrained(model_path, config, detokenize=tokenizer.decode)
        if tokenizer.eos_token_id is not None:
            core.eos_token_ids |= {tokenizer.eos_token_id}
    except Exception as err:  # noqa: BLE001 - reported to the server, which exits with it
        log.exception("the engine could not be built")
        await push.send(_pack(["failed", f"{type(err).__name__}: {err}"]))
        return
    engine = AsyncLLMEngine(core)
    transfer = WeightTransfer(engine)

    def status(memory: bool = False) -> dict:
        # the allocator's figures only in the periodic report: torch.cuda.memory_stats builds a large
        # dict, and taking it with every output held the GIL the engine thread needs (10% of a step)
        out = {
            "is_paused": engine.is_paused,
            "is_sleeping": engine.is_sleeping,
            "stats": asdict(engine.stats()),
        }
        if memory:
            out["memory_gb"] = engine.memory_gb()
        return out

    await push.send(
        _pack(
            [
                "ready",
                {
                    "pid": os.getpid(),
                    "device": str(core.device),
                    "max_model_len": core.config.max_model_len,
                    "vocab_size": core.model.config.vocab_size,
                    "engine_s": time.perf_counter() - started,
                    "startup_s": dict(core.runner.startup_s),
                    "status": status(memory=True),
                },
            ]
        )
    )
    ops = {
        "abort": engine.abort,
        "pause": engine.pause,
        "resume": engine.resume,
        "sleep": engine.sleep,
        "wake_up": engine.wake_up,
        "reset_prefix_cache": transfer.reset_prefix_cache,
        "weight_info": transfer.weight_info,
        "init": lambda info: transfer.init(InitInfo.model_validate(info)),
        "shutdown": transfer.shutdown,
        "start": transfer.start,
        "update": transfer.update,
        "finish": transfer.finish,
    }
    requests: dict[str, asyncio.Task] = {}

    async def run_request(rid: str, prompt: list[int], params: dict, priority: int) -> None:
        try:
            out = await engine.generate(prompt, SamplingParams(**params), rid, priority)
            await push.send(_pack(["output", rid, encode_output(out), status()]))
        except asyncio.CancelledError:
            pass  # the server stopped waiting (its client went away); the engine aborted the request
        except Exception as err:  # noqa: BLE001 - every failure goes back to that request alone
            kind, message, _ = _error_fields(err)
            await push.send(_pack(["request_error", rid, kind, message]))
        finally:
            requests.pop(rid, None)

    async def run_call(call_id: int, op: str, args: dict) -> None:
        try:
            result = await ops[op](**args)
        except Exception as err:  # noqa: BLE001 - the caller gets it, with its HTTP status
            await push.send(_pack(["call_error", call_id, *_error_fields(err), status()]))
        else:
            await push.send(_pack(["reply", call_id, result, status()]))

    async def report() -> None:
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            if os.getppid() != parent_pid:  # the server is gone: nobody can reach this engine
                log.error("the server process %d exited; the engine process stops", parent_pid)
                os._exit(1)
            await push.send(_pack(["status", status(memory=True)]))

    pull = ctx.socket(zmq.PULL)
    pull.connect(inbox)
    reporter = asyncio.create_task(report())
    calls: set[asyncio.Task] = set()
    try:
        while True:
            message = _unpack(await pull.recv())
            kind = message[0]
            if kind == "generate":
                _, rid, prompt, params, priority = message
                requests[rid] = asyncio.create_task(run_request(rid, prompt, params, priority))
            elif kind == "cancel":
                task = requests.get(message[1])
                if task is not None:
                    task.cancel()
            elif kind == "call":
                task = asyncio.create_task(run_call(message[1], message[2], message[3]))
                calls.add(task)
                task.add_done_callback(calls.discard)
    finally:
        reporter.cancel()
        with contextlib.suppress(Exception):
            engine.shutdown()
