"""``LLMEngine`` driven by one background thread, for asyncio callers (the HTTP server).

The engine is single-threaded by design: every mutation (new request, abort, pause, weight
update) is a command queued to the engine thread and executed between two steps, so a weight
update never lands in the middle of a forward pass and the event loop never waits for a step.
Results come back to the caller's event loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from refractor.errors import one_line
from refractor.inference.engine.llm_engine import EngineStats, LLMEngine
from refractor.inference.engine.sampling_params import SamplingParams
from refractor.inference.engine.sequence import RequestOutput
from refractor.telemetry.torch_memory import torch_memory_gb

log = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "keep", "wait")


class EngineDeadError(RuntimeError):
    """The engine failed as a whole (a step failed for each of its requests, or outside any request's
    work): every request in flight ends with this error."""


class RequestFailedError(RuntimeError):
    """This request's work raised inside an engine step; the step's other requests went on."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        # streamed requests (engine thread only): their progress goes out after every step
        self._partials: dict[str, _PartialSink] = {}
        self._hold_new = False  # pause(mode="wait") in progress: new requests wait their turn
        self._held: list[Callable[[], None]] = []
        self._stats = engine.stats()
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="refractor-engine", daemon=True)
        self._thread.start()

    # ---- engine thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while self._running:
            self._drain_commands()
            if not self.engine.has_work:
                self._stats = self.engine.stats()
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as err:  # failed for everyone: fail what is in flight, keep the process
                log.exception("engine step failed; aborting in-flight requests")
                self._fail_all(err)
                continue
            self._deliver(outputs)
            self._publish_partials()
            self._stats = self.engine.stats()

    def _publish_partials(self) -> None:
        """Each streamed request that got tokens in this step: its output so far, to its caller."""
        for request_id, sink in self._partials.items():
            request = self.engine.requests.get(request_id)
            if request is None:
                continue
            counts = tuple(seq.num_output_tokens for seq in request.seqs)
            if counts != sink.counts:
                sink.counts = counts
                with contextlib.suppress(RuntimeError):  # a closed caller loop: nobody listens
                    sink.loop.call_soon_threadsafe(sink.callback, self.engine.partial_output(request_id))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, outputs: Iterable[RequestOutput]) -> None:
        for output in outputs:
            self._partials.pop(output.request_id, None)
            waiter = self._waiters.pop(output.request_id, None)
            if waiter is None:
                continue
            if output.error is None:
                _post(*waiter, output, None)
            else:
                message = f"request {output.request_id!r} failed in the engine: {output.error}"
                _post(*waiter, None, RequestFailedError(message))

    def _fail_all(self, err: Exception) -> None:
        try:
            self.engine.abort()
        except Exception:
            log.exception("abort after a failed step also failed")
        for loop, future in self._waiters.values():
            _post(loop, future, None, EngineDeadError(f"engine step failed: {one_line(err)}"))
        self._waiters.clear()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread between steps; the returned future holds its result."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("AsyncLLMEngine.call from the engine thread would deadlock")
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as err:
                    future.set_exception(err)
                else:
                    # a control call may record the launched step: its counts show in the stats
                    # before the caller resumes (a pause's reply carries them)
                    self._stats = self.engine.stats()
                    future.set_result(result)

        self._commands.put(run)
        self._wakeup.set()
        return future

    async def _call_async(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    # ---- requests ----------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        on_partial: Callable[[RequestOutput], None] | None = None,
    ) -> RequestOutput:
        """Run one request to completion. Cancelling the awaiting task aborts it and frees its KV.

        ``on_partial`` (a streamed request) is called on the caller's loop with the output so far
        after each engine step that added tokens to it, before the final output is returned."""
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        result: asyncio.Future = loop.create_future()

        def add() -> None:
            if request_id in self._waiters:
                raise ValueError(f"request id {request_id!r} is already in flight")
            if self._hold_new:
                self._held.append(add_now)
            else:
                add_now()

        def add_now() -> None:
            self.engine.add_request(request_id, prompt_token_ids, params, priority)
            self._waiters[request_id] = (loop, result)
            if on_partial is not None:
                self._partials[request_id] = _PartialSink(loop, on_partial)

        await self._call_async(add)
        try:
            return await result
        except asyncio.CancelledError:
            self.call(lambda: self._deliver_aborted([request_id]))
            raise

    def _deliver_aborted(self, request_ids: list[str] | None) -> int:
        outputs = self.engine.abort(request_ids)
        self._deliver(outputs)
        return len(outputs)

    async def abort(self, request_ids: list[str] | None = None) -> int:
        """Abort these requests (None or empty: all); they return with ``finish_reason="abort"``."""
        return await self._call_async(lambda: self._deliver_aborted(request_ids or None))

    # ---- control (mirrors vLLM's /pause, /resume) --------------------------------------------
    async def pause(self, mode: str = "abort") -> None:
        """abort: end in-flight requests now; keep: freeze them until ``resume``; wait: let them finish.

        In every mode, requests that arrive while paused are queued and start on ``resume``. The
        state machine (one pause, not counted; nothing ever waits on a frozen request):

        * pause while paused: the engine stays paused; ``abort`` also ends the requests frozen in
          flight; ``keep`` and ``wait`` return at once (nothing runs while paused).
        * pause(wait) while another pause(wait) drains: waits for the same drain.
        * resume: ends the pause, whoever asked for it and in whatever mode; a pause(wait) still
          draining returns without pausing (the resume came after it). Resume while running: no-op.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if mode == "wait":
            if await self._drained():
                await self._call_async(self._pause_if_held)
            # else already paused: nothing runs, nothing to wait for
        elif mode == "keep":
            await self._call_async(lambda: self._pause_now("keep"))
        else:
            await self._call_async(lambda: self._deliver(self._pause_now("abort")))

    async def _drained(self) -> bool:
        """Hold new requests and wait until the ones in flight finished; False (at once) when the
        engine is paused, as nothing would finish then."""
        if not await self._call_async(self._hold_unless_paused):
            return False
        while await self._call_async(self._draining):
            await asyncio.sleep(0.01)
        return True

    def _hold_unless_paused(self) -> bool:
        """Engine thread: start holding new requests for a wait-pause; False when already paused."""
        if self.engine.paused:
            return False
        self._hold_new = True
        return True

    def _draining(self) -> bool:
        return self._hold_new and self.engine.has_unfinished()

    def _pause_if_held(self) -> None:
        """Engine thread: the drain ended; pause unless a resume cancelled the wait meanwhile."""
        if self._hold_new:
            self.engine.pause("keep")
            self._admit_held()

    def _pause_now(self, mode: str) -> list[RequestOutput]:
        outputs = self.engine.pause(mode)
        self._admit_held()  # requests held by a wait-pause now queue behind the pause
        return outputs

    def _admit_held(self) -> None:
        self._hold_new = False
        held = self._held
        self._held = []
        for add_now in held:
            add_now()

    async def resume(self) -> None:
        await self._call_async(self._resume)

    def _resume(self) -> None:
        self._admit_held()
        self.engine.resume()

    @property
    def is_paused(self) -> bool:
        return self.engine.paused or self._hold_new

    # ---- sleep mode (mirrors vLLM's /sleep, /wake_up) -----------------------------------------
    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Release the engine's memory (``LLMEngine.sleep``) once in-flight requests are dealt with as
        ``mode`` says: abort them, keep them (they re-prefill after the wake) or wait for them. New
        requests wait until the engine is awake; a ``/pause`` in effect stays in effect."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"sleep mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.engine.check_sleep(level)  # before any request is aborted or held
        if mode == "wait" and await self._drained():
            await self._call_async(lambda: self._sleep_now(level, "keep"))
        else:
            await self._call_async(lambda: self._sleep_now(level, mode))

    def _sleep_now(self, level: int, mode: str) -> None:
        if mode == "abort":
            self._deliver(self.engine.abort())
        self.engine.sleep(level)
        self._admit_held()  # requests held while draining queue up behind the sleep

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Take back the memory of ``tags`` (None: all); True when the engine is fully awake."""

        def wake() -> bool:
            self.engine.wake_up(tags)
            return not self.engine.is_sleeping

        return await self._call_async(wake)

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    # ---- weights -----------------------------------------------------------------------------
    @property
    def weight_version(self) -> int | str:
        return self.engine.weight_version

    def set_weight_version(self, version: int | str) -> None:
        self.call(lambda: setattr(self.engine, "weight_version", version)).result()

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | str | None = None,
        recompute_kv: bool = True,
    ) -> int:
        """Thread-safe, blocking: copy tensors in by HF name between steps (see ``LLMEngine.update_weights``).

        Call it from a worker thread (e.g. ``await asyncio.to_thread(engine.update_weights, ...)``);
        the iterable is consumed on the engine thread, so it may receive tensors lazily.
        """
        return self.call(lambda: self.engine.update_weights(named_tensors, version, recompute_kv)).result()

    async def update_weights_async(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | str | None = None,
        recompute_kv: bool = True,
    ) -> int:
        return await self._call_async(
            lambda: self.engine.update_weights(named_tensors, version, recompute_kv)
        )

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        await self._call_async(lambda: self.engine.reset_prefix_cache(reset_running_requests))

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Live parameters by HF name; read them while paused (e.g. for checksums)."""
        return self.engine.named_parameters()

    def update_names(self, adapters: bool) -> list[str]:
        """The names a complete weight (or LoRA adapter) update writes (``LLMEngine.update_names``)."""
        return self.engine.update_names(adapters)

    # ---- introspection / lifecycle -----------------------------------------------------------
    async def connect(self) -> None:
        """Nothing to connect: the engine thread runs in this process (an engine process's client
        starts reading its messages here)."""

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model.config.vocab_size

    def memory_gb(self) -> dict[str, float]:
        """The torch allocator's figures for the engine's device (empty on CPU)."""
        return torch_memory_gb(self.engine.device)

    def shutdown(self) -> None:
        self._running = False
        self._wakeup.set()
        self._thread.join(timeout=10)


@dataclass
class _PartialSink:
    loop: asyncio.AbstractEventLoop
    callback: Callable[[RequestOutput], None]
    counts: tuple[int, ...] = ()  # output tokens per sequence when last published


async def stream_outputs(
    engine: Any,
    prompt_token_ids: list[int],
    params: SamplingParams,
    request_id: str | None = None,
    priority: int = 0,
) -> AsyncIterator[RequestOutput]:
    """One request's outputs so far (finish reasons None while a sequence runs), then its final
    output. ``engine``: anything with ``AsyncLLMEngine.generate``'s signature (the engine process's
    client too). Closing the iterator early aborts the request."""
    progress: asyncio.Queue = asyncio.Queue()
    task = asyncio.ensure_future(
        engine.generate(prompt_token_ids, params, request_id, priority, on_partial=progress.put_nowait)
    )
    task.add_done_callback(lambda _: progress.put_nowait(None))
    try:
        while (partial := await progress.get()) is not None:
            yield partial
        yield task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _post(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future,
    output: RequestOutput | None,
    error: Exception | None,
) -> None:
    with contextlib.suppress(RuntimeError):  # a closed caller loop: nobody is waiting any more
        loop.call_soon_threadsafe(_resolve, future, output, error)


def _resolve(future: asyncio.Future, output: RequestOutput | None, error: Exception | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(output)
