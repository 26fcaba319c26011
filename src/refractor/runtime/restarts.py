"""A dead or hung inference server is replaced, and the run goes on.

Rules:

* Each server is restarted at most ``inference_restart_on_failure`` times; its next failure stops
  the run with the server's name, as without restarts (0: the first failure does).
* While a server restarts, nothing else stops: its lanes are held, its groups in flight are
  cancelled (recorded with the reason ``server_restart``) and their prompts go back to the
  stream, so they run again, on the other servers or on this one once it is back.
* The new process runs on the server's own Ray bundle (the same GPUs). Before it serves, trainer
  rank 0 gives it the weights the trainer holds, labelled with their version, through the normal
  update protocol (pause, stream, finish, canary) on a group of its own; later updates include it
  again. Weight pushes never overlap (the orchestrator's ``weights_lock``), and an update that
  failed because a server died runs again once that server is back.
* A restart that fails (the new process does not start, or its first weights fail the canary)
  stops the run, named.
* Recorded: a ``server_restart`` event in the run store's timeline, from the moment the failure was
  found to the moment the server serves again, with the server, the reason, the restart count
  and the weight version it got; a warning on the console.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from refractor.inference.process import ServerStartError
from refractor.records import DiscardReason, TimelineEvent
from refractor.runtime.health import ComponentFailure, ServerWatchdog


class RestartHost(Protocol):
    """What a restart needs from the orchestrator."""

    weights_lock: asyncio.Lock

    def take_out_server(self, name: str, reason: str) -> None: ...

    def bring_back_server(self, name: str) -> None: ...

    def record(self, event: TimelineEvent) -> None: ...

    def warn(self, message: str, event: str, **attrs: Any) -> None: ...


class ServerRestarter:
    """Replaces servers found dead or hung: the watchdog's ``on_failure`` and the orchestrator's
    ``server_recovery``.

    ``servers`` restarts a server's process (``restart(name) -> ServerInfo``, blocking, with its
    ``restarts`` count per name); ``trainers`` pushes the current weights to it
    (``refresh_server``); ``clients`` are the run's HTTP clients by server name, moved to the new
    URL.
    """

    def __init__(
        self,
        servers: Any,
        trainers: Any,
        clients: Mapping[str, Any],
        host: RestartHost,
        watchdog: ServerWatchdog,
        limit: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.servers = servers
        self.trainers = trainers
        self.clients = dict(clients)
        self.host = host
        self.watchdog = watchdog
        self.limit = limit
        self.clock = clock
        self._running: dict[str, asyncio.Future] = {}

    async def on_failure(self, name: str, failure: ComponentFailure) -> bool:
        """Replace server ``name`` (waiting for a restart already under way); False when its
        restarts are used up, so the run stops with ``failure``."""
        task = self._running.get(name)
        if task is None:
            if self.servers.restarts[name] >= self.limit:
                if self.limit:
                    raise ComponentFailure(
                        f"{failure}\nIt was restarted {self.limit} time(s) already "
                        f"(inference_restart_on_failure = {self.limit})"
                    ) from None
                return False
            task = asyncio.ensure_future(self._restart(name, failure))
            self._running[name] = task
            task.add_done_callback(lambda _: self._running.pop(name, None))
        await asyncio.shield(task)
        return True

    async def recover(self, error: BaseException) -> bool:
        """After a weight update failed with ``error``: replace every server found dead. True when
        one was (or is being) replaced, so the update may run again."""
        dead = await self.watchdog.dead_servers()
        names = set(dead) | set(self._running)
        if not names:
            return False
        for name in sorted(names):
            failure = dead.get(name) or ComponentFailure(f"inference server {name} is being restarted")
            if not await self.on_failure(name, failure):
                raise failure from error
        return True

    async def _restart(self, name: str, failure: ComponentFailure) -> None:
        start = self.clock()
        count = self.servers.restarts[name] + 1
        reason = str(failure).splitlines()[0]
        self.host.warn(
            f"{reason} Restarting it ({count} of at most {self.limit}); its groups run again meanwhile.",
            "server_restart_start",
            server=name,
        )
        self.host.take_out_server(name, DiscardReason.SERVER_RESTART)
        try:
            info = await asyncio.to_thread(self.servers.restart, name)
        except ServerStartError as err:
            raise ComponentFailure(
                f"inference server {name} died and could not be restarted: {err}"
            ) from None
        self.clients[name].rebase(info.url)
        async with self.host.weights_lock:
            sync = await self.trainers.refresh_server(name, info.url)
        for event in sync:  # the weight_sync span first, then its phases
            self.host.record(event)
        self.host.bring_back_server(name)
        self.host.record(
            TimelineEvent(
                "server_restart",
                start,
                self.clock(),
                "inference",
                {
                    "server": name,
                    "reason": reason,
                    "restart": count,
                    "limit": self.limit,
                    "url": info.url,
                    "version": sync[0].attrs["version"],
                },
            )
        )
