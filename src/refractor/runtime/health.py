"""Heartbeats and timeouts: a dead or hung component stops the run with its name, not a silent stall.

Two kinds of component, two mechanisms:

* **Inference servers** are polled by :class:`ServerWatchdog`, a task beside the orchestrator. Every
  ``heartbeat_interval_s`` it asks each server's actor whether the server process still runs (a
  dead process fails the run at once, with the error its log names and its last log lines) and
  probes ``/health``; a server that has not answered for ``heartbeat_timeout_s`` fails the run as
  hung. Generation requests to a dead server fail fast anyway, but without the watchdog the run
  would keep discarding rollouts and never finish a step. With ``on_failure``
  (``refractor.runtime.restarts``) a dead or hung server is first replaced, up to a limit.
* **Trainer ranks** cannot answer while they compute, so each call to them (step, weight sync,
  checkpoint) has a deadline, ``trainer_call_timeout_s``: :func:`await_ranks` names the ranks that
  died (their actor is gone) or did not finish in time (a hung collective waits forever otherwise).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import ray

from refractor.errors import RefractorUserError


class ComponentFailure(RefractorUserError, RuntimeError):
    """A server or trainer rank died or stopped answering; the message names it and says what it was doing."""


@dataclass(frozen=True)
class HeartbeatSettings:
    interval_s: float = 10.0
    timeout_s: float = 120.0
    trainer_call_timeout_s: float = 3600.0

    @classmethod
    def from_config(cls, cfg: Any) -> HeartbeatSettings:
        return cls(cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s, cfg.trainer_call_timeout_s)


class Probe(Protocol):
    name: str

    async def health(self) -> bool: ...


ProcessCheck = Callable[[str], Awaitable[tuple[bool, str]]]  # name -> (process alive, exit report)
# a server found dead or hung -> True when it was replaced (the watch goes on), else the run stops
FailureHandler = Callable[[str, "ComponentFailure"], Awaitable[bool]]


class ServerWatchdog:
    """Fails (raises :class:`ComponentFailure`) when a server's process dies or it stops answering."""

    def __init__(
        self,
        servers: Sequence[Probe],
        settings: HeartbeatSettings,
        process_check: ProcessCheck | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_failure: FailureHandler | None = None,
    ) -> None:
        self.servers = list(servers)
        self.settings = settings
        self.process_check = process_check
        self.clock = clock
        self.on_failure = on_failure
        self.last_ok = {s.name: clock() for s in self.servers}

    async def watch(self) -> None:
        """Run until cancelled; raise on the first dead or hung server."""
        while True:
            await asyncio.sleep(self.settings.interval_s)
            await self.check()

    async def diagnose(self) -> ComponentFailure | None:
        """After another part of the run failed: is a server process gone? (the likelier root cause)"""
        dead = await self.dead_servers()
        return next(iter(dead.values()), None)

    async def check(self) -> None:
        answers = await asyncio.gather(*(s.health() for s in self.servers), return_exceptions=True)
        now = self.clock()
        for server, ok in zip(self.servers, answers, strict=True):
            if ok is True:
                self.last_ok[server.name] = now
                continue
            failure = await self._failure_of(server, now)
            if failure is None:
                continue
            if self.on_failure is not None and await self.on_failure(server.name, failure):
                self.last_ok[server.name] = self.clock()  # replaced: its silence starts again
                continue
            raise failure

    async def _failure_of(self, server: Probe, now: float) -> ComponentFailure | None:
        """A server that did not answer /health: dead (its process is gone), hung (silent for
        ``timeout_s``) or, so far, neither (None)."""
        if self.process_check is not None:
            alive, tail = await self.process_check(server.name)
            if not alive:
                return _exited(server, tail)
        silent = now - self.last_ok[server.name]
        if silent >= self.settings.timeout_s:
            return ComponentFailure(
                f"inference server {server.name} has not answered /health for {silent:.0f} s "
                f"(heartbeat_timeout_s = {self.settings.timeout_s:g}); it is hung or overloaded"
            )
        return None

    async def dead_servers(self) -> dict[str, ComponentFailure]:
        """Every server whose process is gone, with its failure (none without a process check)."""
        if self.process_check is None:
            return {}
        checks = await asyncio.gather(*(self.process_check(s.name) for s in self.servers))
        return {
            server.name: _exited(server, tail)
            for server, (alive, tail) in zip(self.servers, checks, strict=True)
            if not alive
        }


def actor_process_check(actor_of: Callable[[str], Any], timeout_s: float = 30.0) -> ProcessCheck:
    """Ask a server's Ray actor (``actor_of(name)``, the current one: a restart may replace it)
    whether its server process runs; a dead actor counts as a dead server."""

    async def check(name: str) -> tuple[bool, str]:
        actor = actor_of(name)
        try:
            alive = await asyncio.wait_for(await_ref(actor.alive.remote()), timeout_s)
            report = "" if alive else await asyncio.wait_for(await_ref(actor.exit_report.remote()), timeout_s)
            return bool(alive), report
        except ray.exceptions.RayActorError as err:
            return False, f"(its Ray actor died: {err})"
        except TimeoutError:
            return True, ""  # the actor is busy, not gone: the /health deadline decides

    return check


async def await_ref(ref: Any) -> Any:
    """An awaitable of a Ray ObjectRef (or any awaitable), for asyncio.wait_for and tasks."""
    return await ref


async def await_ranks(refs: Sequence[Any], what: str, timeout_s: float) -> list[Any]:
    """Results of one call on every trainer rank, in rank order; a dead or late rank fails by number."""
    tasks = [asyncio.ensure_future(await_ref(r)) for r in refs]
    try:
        done, pending = await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        for rank, task in enumerate(tasks):
            if task in done and task.exception() is not None:
                err = task.exception()
                if isinstance(err, ray.exceptions.RayActorError):
                    raise ComponentFailure(f"trainer rank {rank} died during {what}: {err}") from None
                if isinstance(err, ray.exceptions.RayTaskError) and err.cause is not None:
                    raise err.cause from None  # the rank's own error, without Ray's wrapper text
                raise err
        if pending:
            late = [rank for rank, t in enumerate(tasks) if t in pending]
            finished = [rank for rank, t in enumerate(tasks) if t in done]
            raise ComponentFailure(
                f"trainer rank(s) {late} did not finish {what} within {timeout_s:g} s "
                "(trainer_call_timeout_s)"
                + (f"; rank(s) {finished} did" if finished else "")
                + ". A rank stuck in a collective (NCCL/gloo) or a hung step; "
                "see the rank logs under <run>/logs"
            )
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()


def _exited(server: Probe, report: str) -> ComponentFailure:
    return ComponentFailure(
        f"inference server {server.name} ({getattr(server, 'base_url', '?')}): its "
        "process exited during the run." + (f"\n{report.rstrip()}" if report.strip() else "")
    )
