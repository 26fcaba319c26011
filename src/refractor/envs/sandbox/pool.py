"""A pool of pre-created sandboxes, so that a reward never waits for sandbox start-up.

Every sandbox is used once: ``release`` closes it and the pool creates a fresh one, so nothing a
program leaves behind (files, state) can reach the next program. All work happens on the
caller's event loop (no producer thread with a second loop).
"""

from __future__ import annotations

import asyncio
import logging
import time

from refractor.envs.sandbox.protocol import (
    Sandbox,
    SandboxConfig,
    SandboxError,
    SandboxProvider,
    SandboxUnavailableError,
)

logger = logging.getLogger(__name__)


class SandboxPool:
    def __init__(
        self, provider: SandboxProvider, config: SandboxConfig, size: int = 4, max_concurrent_creates: int = 8
    ) -> None:
        if size < 1:
            raise ValueError(f"sandbox pool size must be >= 1, got {size}")
        self.provider = provider
        self.config = config
        self.size = size
        self.max_concurrent_creates = max_concurrent_creates
        self._ready: asyncio.Queue[Sandbox] | None = None
        self._slots: asyncio.Semaphore | None = None
        self._fillers: list[asyncio.Task] = []
        self._in_use: set[Sandbox] = set()
        self._fatal: BaseException | None = None
        self._closed = False

    @property
    def num_ready(self) -> int:
        return self._ready.qsize() if self._ready else 0

    async def start(self) -> None:
        """Begin pre-warming (idempotent)."""
        if self._fillers or self._closed:
            return
        self._ready = asyncio.Queue()
        self._slots = asyncio.Semaphore(self.size)
        self._fillers = [
            asyncio.create_task(self._fill()) for _ in range(min(self.size, self.max_concurrent_creates))
        ]

    async def _fill(self) -> None:
        backoff = 0.1
        while not self._closed:
            await self._slots.acquire()  # one permit per ready-or-being-created sandbox
            try:
                sandbox = await self.provider.create(self.config)
            except SandboxUnavailableError as err:
                self._fatal = err
                self._slots.release()
                return
            except Exception as err:  # transient: retry with backoff
                logger.warning("sandbox creation failed (%s: %s); retrying", type(err).__name__, err)
                self._slots.release()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            backoff = 0.1
            await self._ready.put(sandbox)

    async def wait_ready(self, count: int | None = None, timeout_s: float = 60.0) -> None:
        """Wait until ``count`` (default: all) sandboxes are pre-created."""
        await self.start()
        deadline = time.monotonic() + timeout_s
        while self.num_ready < (count or self.size):
            if self._fatal:
                raise self._fatal
            if time.monotonic() > deadline:
                raise SandboxError(
                    f"sandbox pool: only {self.num_ready}/{count or self.size} ready after {timeout_s}s"
                )
            await asyncio.sleep(0.01)

    async def acquire(self, timeout_s: float = 600.0) -> Sandbox:
        await self.start()
        deadline = time.monotonic() + timeout_s
        while True:
            if self._fatal:
                raise self._fatal
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SandboxError(f"no sandbox became available within {timeout_s}s (pool size {self.size})")
            try:
                sandbox = await asyncio.wait_for(self._ready.get(), min(remaining, 0.5))
            except TimeoutError:
                continue
            self._slots.release()
            if getattr(sandbox, "age_s", 0.0) > 0.9 * self.config.timeout_s:
                await sandbox.close()  # too close to its lifetime limit
                continue
            self._in_use.add(sandbox)
            return sandbox

    async def release(self, sandbox: Sandbox) -> None:
        self._in_use.discard(sandbox)
        await sandbox.close()

    async def close(self) -> None:
        self._closed = True
        for task in self._fillers:
            task.cancel()
        await asyncio.gather(*self._fillers, return_exceptions=True)
        leftovers = list(self._in_use)
        while self._ready is not None and not self._ready.empty():
            leftovers.append(self._ready.get_nowait())
        await asyncio.gather(*(s.close() for s in leftovers), return_exceptions=True)
        self._in_use.clear()
