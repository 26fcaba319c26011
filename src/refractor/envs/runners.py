"""Where blocking environment code runs: the reward thread pool and reward worker processes.

* ``run_blocking`` runs a sync function in the reward thread pool (sync Rubric functions, sync
  ``compute_reward`` and sync tools go there automatically, through ``call_maybe_async``).
* ``ProcessRunner`` runs picklable CPU-bound functions (math verification) in worker processes,
  where signal-based timeouts work and an overrunning call can be killed, which a thread cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

_REWARD_THREADS = ThreadPoolExecutor(
    max_workers=int(os.environ.get("REFRACTOR_REWARD_THREADS", "16")), thread_name_prefix="refractor-reward"
)


async def run_blocking(fn, *args: Any, **kwargs: Any) -> Any:
    """Run a blocking call in the reward thread pool (its own pool, so a stuck reward cannot starve
    asyncio's default executor)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_REWARD_THREADS, functools.partial(fn, *args, **kwargs))


async def call_maybe_async(fn, *args: Any, **kwargs: Any) -> Any:
    """Call sync or async ``fn``; sync functions run in the reward thread pool, off the event loop."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await run_blocking(fn, *args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


class _Worker:
    """One ``refractor.envs.worker`` subprocess, used by one call at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "refractor.envs.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def _read_exact(self, count: int, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        chunks = []
        size = 0
        while size < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
            chunk = os.read(fd, count - size)
            if not chunk:
                raise _WorkerDied("reward worker process exited")
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)

    def call(self, fn, args: tuple, timeout_s: float) -> Any:
        from refractor.envs.worker import HEADER_BYTES, encode

        deadline = time.monotonic() + timeout_s
        try:
            self.proc.stdin.write(encode((fn, args)))
            self.proc.stdin.flush()
        except BrokenPipeError as err:
            raise _WorkerDied("reward worker process exited") from err
        size = int.from_bytes(self._read_exact(HEADER_BYTES, deadline), "big")
        ok, value = pickle.loads(self._read_exact(size, deadline))
        if not ok:
            raise value
        return value

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()


class _WorkerDied(RuntimeError):
    pass


class ProcessRunner:
    """Worker processes for picklable CPU-bound calls (functions importable by module path).

    Workers are plain subprocesses (``python -m refractor.envs.worker``), so the parent's
    ``__main__`` is never re-imported. A call that overruns its timeout kills its worker (the only
    way to stop it); the next call starts a fresh one. At most ``processes`` calls run at once.
    """

    def __init__(self, processes: int = 2) -> None:
        self.processes = processes
        self._slots = threading.BoundedSemaphore(processes)
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def run_sync(self, fn, *args: Any, timeout_s: float) -> Any:
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            worker = worker or _Worker()
            try:
                result = worker.call(fn, args, timeout_s)
            except TimeoutError:
                worker.kill()
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} took longer than {timeout_s:g}s") from None
            except _WorkerDied:
                worker.kill()
                raise
            except BaseException:
                self._give_back(worker)  # the function itself raised: the worker is fine
                raise
            self._give_back(worker)
            return result

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    async def run(self, fn, *args: Any, timeout_s: float) -> Any:
        return await run_blocking(self.run_sync, fn, *args, timeout_s=timeout_s)

    def close(self) -> None:
        with self._lock:
            workers = self._idle
            self._idle = []
        for worker in workers:
            worker.kill()


_SHARED_RUNNER: ProcessRunner | None = None


def shared_process_runner() -> ProcessRunner:
    """One process pool per process for CPU-bound reward helpers (created on first use)."""
    global _SHARED_RUNNER
    if _SHARED_RUNNER is None:
        _SHARED_RUNNER = ProcessRunner(processes=int(os.environ.get("REFRACTOR_REWARD_PROCESSES", "2")))
    return _SHARED_RUNNER
