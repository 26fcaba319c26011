"""Log lines of every component, into the driver's run store and ``runs/<run>/logs/``.

Each component keeps its lines in a bounded buffer in its own process (refractor.telemetry.
log_capture): the driver and the orchestrator, each trainer rank (its Python logging and its
stdout/stderr), each inference server actor (the lines its server process appends to its log
file, read on the server's node). Every ``interval_s`` the driver's :class:`LogCollector` drains
the driver's buffer and asks every actor for its lines over a Ray call (``drain_logs``, served
beside the actor's other work), then stores them and appends them to the plain-text copies.
Nothing assumes a shared file system or one machine. Lines a buffer dropped are recorded as one
WARNING line saying how many; an actor that does not answer is recorded once as a
``log_collection_failed`` warning event (and asked again: a restarted server answers again).
A drain that answers late is not abandoned: the lines it took from the actor's buffer are in its
answer, so the next collection waits for that same call instead of starting another.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from refractor.records import TimelineEvent
from refractor.runtime.health import await_ref
from refractor.telemetry.log_capture import LogBatch, LogLine, ProcessLogs
from refractor.telemetry.log_files import LogFileCopies

log = logging.getLogger(__name__)

COLLECT_INTERVAL_S = 1.0  # the dashboard's live log view shows new lines within about this


@dataclass
class LogSource:
    component: str
    rank: int | None
    drain: Callable[[], Any]  # starts the actor's drain_logs call: an ObjectRef of a LogBatch
    failing: bool = False
    pending: Any = None  # a drain call that had not answered by the last collection's timeout

    def call(self) -> Any:
        """The drain call to wait for: the one still pending, else a new one."""
        if self.pending is None:
            self.pending = self.drain()
        return self.pending

    @property
    def name(self) -> str:
        return self.component if self.rank is None else f"{self.component}-{self.rank}"


class LogCollector:
    """Collects ``local`` (this process's lines) and every added source into ``store_lines`` and
    ``copies``; ``warn(event)`` records a source that stopped answering."""

    def __init__(
        self,
        local: ProcessLogs,
        store_lines: Callable[[list[LogLine]], None],
        copies: LogFileCopies,
        warn: Callable[[TimelineEvent], None],
        interval_s: float = COLLECT_INTERVAL_S,
        call_timeout_s: float = 30.0,
    ) -> None:
        self.local = local
        self.store_lines = store_lines
        self.copies: LogFileCopies | None = copies  # None once writing them failed
        self.warn = warn
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self.sources: list[LogSource] = []
        # a collection cancelled at shutdown may still be recording in its thread when the last
        # collection starts
        self._recording = threading.Lock()

    def add_actor_source(self, component: str, rank: int | None, drain: Callable[[], Any]) -> None:
        self.sources.append(LogSource(component, rank, drain))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.collect()

    async def collect(self) -> None:
        async def answer(source: LogSource) -> Any:
            ref = _call(source.call)
            if isinstance(ref, BaseException):
                return ref
            try:  # shielded: a timeout leaves the call running, to be waited for next time
                return await asyncio.wait_for(asyncio.shield(await_ref(ref)), self.call_timeout_s)
            except TimeoutError as err:
                return err

        results = await asyncio.gather(*(answer(s) for s in self.sources), return_exceptions=True)
        await asyncio.to_thread(self._record_all, results)

    def collect_now(self, timeout_s: float) -> None:
        """One collection, blocking (the end of the run, before the actors are stopped): every
        source is asked at once and waited for ``timeout_s`` in all."""
        refs = [_call(source.call) for source in self.sources]
        pending = [r for r in refs if not isinstance(r, BaseException)]
        ready = set(ray.wait(pending, num_returns=len(pending), timeout=timeout_s)[0]) if pending else set()
        results = []
        for ref in refs:
            if isinstance(ref, BaseException):
                results.append(ref)
            elif ref in ready:
                results.append(_call(ray.get, ref))
            else:
                results.append(TimeoutError(f"no answer within {timeout_s:g} s"))
        self._record_all(results)

    def close(self, timeout_s: float = 30.0) -> None:
        """A last collection of every source (waiting ``timeout_s`` at most), then the copies are
        closed and this process's capture removed."""
        try:
            self.collect_now(timeout_s)
        finally:
            self.local.close()
            with self._recording:
                self._record(None, self.local.drain())
                if self.copies is not None:
                    self.copies.close()

    def _record_all(self, results: list[Any]) -> None:
        with self._recording:
            self._record(None, self.local.drain())
            for source, result in zip(self.sources, results, strict=True):
                if not isinstance(result, TimeoutError):
                    source.pending = None  # answered (or failed): the next collection starts a new call
                if isinstance(result, BaseException):
                    self._failed(source, result)
                    continue
                source.failing = False
                self._record(source, result)

    def _record(self, source: LogSource | None, batch: LogBatch) -> None:
        lines = list(batch.lines)
        if batch.dropped:
            component, rank = ("driver", None) if source is None else (source.component, source.rank)
            who = component if source is None else source.name
            message = (
                f"refractor: {batch.dropped} lines of {who} were dropped "
                "(more output than the log limits keep; see docs/run-store.md#logs)"
            )
            lines.append(LogLine(time.time(), "WARNING", component, rank, batch.node, "log", message))
        if not lines:
            return
        self.store_lines(lines)
        if self.copies is None:
            return
        try:
            self.copies.write(lines)
        except OSError as err:  # a full disk, a permission: the run store still gets every line
            self.copies = None
            self._warn("log_files_failed", "files", f"the log files in logs/ are no longer written: {err}")

    def _failed(self, source: LogSource, err: BaseException) -> None:
        if source.failing:
            return
        source.failing = True
        message = f"logs of {source.name} could not be collected: {type(err).__name__}: {err}"
        self._warn("log_collection_failed", source.name, message)

    def _warn(self, event: str, source: str, message: str) -> None:
        message = message[:2000]
        log.warning(message)
        now = time.time()
        self.warn(TimelineEvent(event, now, now, "driver", {"source": source, "message": message}))


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or the exception it raised (recorded like a failed call of the loop)."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - a source that fails is recorded, not raised
        return err
