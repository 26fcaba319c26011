"""Local sandboxes: a private working directory plus a way to wrap each command.

``LocalSandbox`` owns the mechanics shared by the local providers: running one command with
stdin, a wall-clock timeout, output caps and the tree-wide memory limit of ``limits.py`` (an overrun
kills the command's whole process tree; so does its end, so nothing it started outlives it), file
transfer that refuses to follow links out of the working directory, a workdir size
check, and cleanup. The providers (``bwrap.py``, ``unisolated.py``) only build the command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Protocol

import psutil

from refractor.envs.sandbox.limits import (
    MemoryLimitMode,
    SandboxCgroup,
    detect_memory_mode,
    watch_tree_memory,
)
from refractor.envs.sandbox.protocol import ExecResult, SandboxClosedError, SandboxConfig, SandboxError

_READ_CHUNK = 65536
_MB = 1024 * 1024
_EXIT_POLL_S = 0.02
_DRAIN_AFTER_EXIT_S = 2.0  # output still buffered when the command is gone; escaped processes get no more


class CommandWrapper(Protocol):
    def wrap(
        self, sandbox: LocalSandbox, argv: list[str], env: dict[str, str]
    ) -> tuple[list[str], str | None]:
        """(full argv, cwd for the host process)"""
        ...


def rlimit_prefix(config: SandboxConfig, *, limit_processes: bool = True) -> list[str]:
    """``prlimit`` arguments enforcing the config's per-process limits (soft = hard)."""
    args = [
        "prlimit",
        f"--as={config.memory_mb * _MB}",
        f"--cpu={config.cpu_time_s}",
        f"--fsize={config.disk_mb * _MB}",
        f"--nofile={config.max_open_files}",
        "--core=0",
    ]
    if limit_processes:
        args.append(f"--nproc={config.max_processes}")
    return [*args, "--"]


def _dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """Returns when the process has exited; ``proc.wait()`` also waits for its pipes to close, which a
    child it left behind can keep open."""
    while proc.returncode is None:
        await asyncio.sleep(_EXIT_POLL_S)


class _CappedReader:
    """Reads one output stream, keeping the first ``cap`` bytes; past the cap it keeps draining (so the
    child never blocks) and sets ``over_cap`` so the command gets killed."""

    def __init__(self, stream: asyncio.StreamReader, cap: int) -> None:
        self.stream = stream
        self.cap = cap
        self.chunks: list[bytes] = []
        self.size = 0
        self.over_cap = asyncio.Event()

    async def drain(self) -> None:
        while chunk := await self.stream.read(_READ_CHUNK):
            if self.size < self.cap:
                self.chunks.append(chunk[: self.cap - self.size])
            self.size += len(chunk)
            if self.size > self.cap:
                self.over_cap.set()

    @property
    def truncated(self) -> bool:
        return self.size > self.cap

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", "replace")


class LocalSandbox:
    def __init__(
        self, wrapper: CommandWrapper, config: SandboxConfig, root: Path, workdir: str, uid: int | None = None
    ) -> None:
        self.id = f"local-{uuid.uuid4().hex[:12]}"
        self.wrapper = wrapper
        self.config = config
        self.root = root
        self.workdir = workdir
        self.uid = uid
        self.host_workdir = root / "work"
        self.created_at = time.monotonic()
        self._procs: set[asyncio.subprocess.Process] = set()
        self._cgroup: SandboxCgroup | None = None
        self.workdir_is_mount = False  # a size-limited tmpfs the provider mounted; unmounted on close
        self._closed = False
        self._broken: str | None = None

    @property
    def age_s(self) -> float:
        return time.monotonic() - self.created_at

    # ----- files -----------------------------------------------------------------------------
    def _host_path(self, path: str) -> Path:
        """Host path of a workdir-relative path; links or '..' leading outside are refused."""
        rel = path[len(self.workdir) :].lstrip("/") if path.startswith(self.workdir + "/") else path
        if os.path.isabs(rel):
            raise SandboxError(f"{self.id}: path {path!r} is outside the sandbox workdir {self.workdir}")
        host = self.host_workdir / rel
        base = os.path.realpath(self.host_workdir)
        real = os.path.realpath(host)
        if not real.startswith(base + os.sep):
            raise SandboxError(f"{self.id}: path {path!r} leaves the sandbox workdir")
        return host

    async def write_file(self, path: str, content: bytes | str) -> None:
        self._check_open()
        data = content.encode() if isinstance(content, str) else content
        host = self._host_path(path)
        host.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(host, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        if self.uid is not None:
            for p in [host, *[q for q in host.parents if str(q).startswith(str(self.host_workdir) + os.sep)]]:
                os.chown(p, self.uid, self.uid)

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        self._check_open()
        host = self._host_path(path)
        try:
            fd = os.open(host, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as err:
            raise SandboxError(f"{self.id}: cannot read {path!r}: {err.strerror}") from err
        with os.fdopen(fd, "rb") as handle:
            return handle.read(max_bytes if max_bytes is not None else self.config.max_output_bytes)

    # ----- exec ------------------------------------------------------------------------------
    def _sandbox_cgroup(self) -> SandboxCgroup | None:
        mode, parent = detect_memory_mode()
        if mode is MemoryLimitMode.CGROUP2 and self._cgroup is None:
            self._cgroup = SandboxCgroup(parent, self.config.memory_mb * _MB, self.config.max_processes)
        return self._cgroup

    async def exec(
        self,
        command: list[str] | str,
        *,
        stdin: bytes | str | None = None,
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        self._check_open()
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        full_env = {**self.config.env, **(env or {})}
        wrapped, cwd = self.wrapper.wrap(self, argv, full_env)
        cgroup = self._sandbox_cgroup()
        leaf = cgroup.new_leaf() if cgroup else None
        oom_kills_before = cgroup.oom_kills() if cgroup else 0
        start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *(SandboxCgroup.enter_prefix(leaf) if leaf else []),
            *wrapped,
            cwd=cwd,
            start_new_session=True,
            env=self._host_env(full_env, cwd),
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        self._procs.add(proc)
        out = _CappedReader(proc.stdout, self.config.max_output_bytes)
        err = _CappedReader(proc.stderr, self.config.max_output_bytes)
        stoppers = {
            asyncio.create_task(_exited(proc)): None,
            asyncio.create_task(out.over_cap.wait()): "output_limit",
            asyncio.create_task(err.over_cap.wait()): "output_limit",
        }
        if leaf is None:
            memory_watch = watch_tree_memory(proc.pid, self.config.memory_mb * _MB)
            stoppers[asyncio.create_task(memory_watch)] = "memory_limit"
        readers = [asyncio.create_task(out.drain()), asyncio.create_task(err.drain())]
        stdin_task = asyncio.create_task(self._feed(proc, stdin))
        try:
            done, _ = await asyncio.wait(stoppers, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            first = next((task for task in stoppers if task in done), None)
            killed = "timeout" if first is None else stoppers[first]
        finally:
            # Whether the command ended or overran, nothing it started may outlive it (or hold its pipes).
            self._kill(proc)
            if leaf is not None:
                await SandboxCgroup.kill_leaf(leaf)
            for task in [*stoppers, stdin_task]:
                task.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_exited(proc), _DRAIN_AFTER_EXIT_S)
            await asyncio.wait(readers, timeout=_DRAIN_AFTER_EXIT_S)
            for task in readers:
                task.cancel()
            self._procs.discard(proc)
        exit_code = None if killed else proc.returncode
        if killed is None and cgroup is not None and cgroup.oom_kills() > oom_kills_before:
            killed = "memory_limit"  # the kernel killed the tree; the exit code says how it ended
        result = ExecResult(
            exit_code=exit_code,
            stdout=out.text(),
            stderr=err.text(),
            timed_out=killed == "timeout",
            output_truncated=out.truncated or err.truncated,
            duration_s=time.perf_counter() - start,
            killed_reason=killed,
        )
        if _dir_size(self.host_workdir) > self.config.disk_mb * _MB:
            self._broken = f"workdir exceeds disk_mb={self.config.disk_mb}"
            result.killed_reason = result.killed_reason or "disk_limit"
        return result

    def _host_env(self, env: dict[str, str], cwd: str | None) -> dict[str, str]:
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        return base if cwd is None else {**base, "HOME": cwd, **env}

    @staticmethod
    async def _feed(proc: asyncio.subprocess.Process, stdin: bytes | str | None) -> None:
        if stdin is None or proc.stdin is None:
            return
        try:
            proc.stdin.write(stdin.encode() if isinstance(stdin, str) else stdin)
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the program exited without reading all input
        finally:
            proc.stdin.close()

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        """Kill the command's process tree and process group (its own session), also when its first
        process has already exited and children it left behind still run."""
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    # ----- lifecycle -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SandboxClosedError(f"sandbox {self.id} is closed")
        if self._broken:
            raise SandboxError(f"sandbox {self.id} is unusable: {self._broken}")
        if self.age_s > self.config.timeout_s:
            raise SandboxError(
                f"sandbox {self.id} reached its lifetime limit (timeout_s={self.config.timeout_s:g})"
            )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in list(self._procs):
            self._kill(proc)
        for proc in list(self._procs):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 5)
        if self._cgroup is not None:
            self._cgroup.remove()
        if self.workdir_is_mount:
            subprocess.run(["umount", "--lazy", str(self.host_workdir)], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def __repr__(self) -> str:
        return f"LocalSandbox({self.id}, {self.wrapper.__class__.__name__}, {self.host_workdir})"
