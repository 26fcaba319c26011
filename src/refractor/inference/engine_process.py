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

Messages: ``engine_wire``; the engine's side: ``engine_core``.

Failure: an engine process that dies fails every request in flight with ``EngineDeadError`` and
``/health`` answers 503; an engine process whose server dies exits within a second.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import zmq
import zmq.asyncio

from refractor.inference.engine.async_engine import EngineDeadError
from refractor.inference.engine.llm_engine import EngineStats
from refractor.inference.engine.sampling_params import SamplingParams
from refractor.inference.engine.sequence import RequestOutput
from refractor.inference.engine_core import engine_main
from refractor.inference.engine_wire import (
    EngineInfo,
    EngineStatus,
    decode_output,
    pack,
    rebuild_error,
    unpack,
)

log = logging.getLogger(__name__)


class EngineProcessClient:
    """``AsyncLLMEngine``'s interface, for an engine that runs in its own process.

    ``start`` is called before the server's event loop exists; the asyncio sockets and the reader
    task are made on first use inside the loop.
    """

    def __init__(
        self,
        proc: multiprocessing.Process,
        workdir: str,
        info: EngineInfo,
        ctx: zmq.Context,
        sockets: tuple[zmq.Socket, zmq.Socket],
    ) -> None:
        self._proc = proc
        self._workdir = workdir
        self.info = info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self._status = info.status
        self._ctx = ctx
        self._sockets = sockets  # (push, pull), bound before the engine process started
        self._push: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._requests: dict[str, asyncio.Future] = {}
        self._partials: dict[str, Callable[[RequestOutput], None]] = {}  # streamed requests' callbacks
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
                    message = unpack(pull.recv())
                    if message[0] == "ready":
                        return cls(proc, workdir, EngineInfo.decode(message[1]), ctx, (push, pull))
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
                self._dispatch(unpack(await pull.recv()))
        except Exception as err:  # noqa: BLE001 - without its reader every waiting request would hang
            log.exception("reading the engine process's messages failed")
            self._fail_all(f"the server lost its link to the engine process: {type(err).__name__}: {err}")

    def _dispatch(self, message: list) -> None:
        kind = message[0]
        if kind == "partial":  # a streamed request's output so far
            callback = self._partials.get(message[1])
            if callback is not None:
                callback(decode_output(message[2]))
        elif kind == "output":  # with the status after it: /metrics counts this request at once
            self._update_status(message[3])
            self._partials.pop(message[1], None)
            _settle(self._requests.pop(message[1], None), decode_output(message[2]))
        elif kind == "request_error":
            self._partials.pop(message[1], None)
            _settle(self._requests.pop(message[1], None), error=rebuild_error(message[2], message[3]))
        elif kind == "reply":
            self._update_status(message[3])
            _settle(self._calls.pop(message[1], None), message[2])
        elif kind == "call_error":
            self._update_status(message[5])
            _settle(self._calls.pop(message[1], None), error=rebuild_error(*message[2:5]))
        elif kind == "status":
            self._update_status(message[1])

    def _update_status(self, fields: list) -> None:
        status = EngineStatus.decode(fields)
        if status.memory_gb is None:  # read only in the periodic report: keep the last figures
            status = replace(status, memory_gb=self._status.memory_gb)
        self._status = status

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
        await push.send(pack(["call", call_id, op, args]))
        return await future

    # ---- AsyncLLMEngine's interface ------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        on_partial: Callable[[RequestOutput], None] | None = None,
    ) -> RequestOutput:
        push = await self._connected()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        future = asyncio.get_running_loop().create_future()
        self._requests[request_id] = future
        if on_partial is not None:
            self._partials[request_id] = on_partial
        stream = on_partial is not None
        await push.send(
            pack(["generate", request_id, list(prompt_token_ids), asdict(params), priority, stream])
        )
        try:
            return await future
        except asyncio.CancelledError:
            self._partials.pop(request_id, None)
            if self._requests.pop(request_id, None) is not None and self._dead is None:
                push.send(pack(["cancel", request_id]))  # queued at once; nobody waits for it
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
        return self._status.is_paused

    @property
    def is_sleeping(self) -> bool:
        return self._status.is_sleeping

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._proc.is_alive()

    def stats(self) -> EngineStats:
        return self._status.stats

    def memory_gb(self) -> dict[str, float]:
        return self._status.memory_gb or {}

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
