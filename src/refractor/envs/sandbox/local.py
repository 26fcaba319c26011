"""Local sandboxes: a private working directory plus a way to wrap each command.

``LocalSandbox`` owns the mechanics shared by the local providers: running one command with
stdin, a wall-clock timeout and output caps (an overrun kills the command's whole process
group), file transfer that refuses to follow links out of the working directory, a workdir size
check, and cleanup. The providers (``bwrap.py``, ``unisolated.py``) only build the command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
import uuid
from pathlib import Path
from typing import Protocol

from refractor.envs.sandbox.protocol import ExecResult, SandboxClosedError, SandboxConfig, SandboxError

_READ_CHUNK = 65536


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
        f"--as={config.memory_mb * 1024 * 1024}",
        f"--cpu={config.cpu_time_s}",
        f"--fsize={config.disk_mb * 1024 * 1024}",
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
        start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *wrapped,
            cwd=cwd,
            start_new_session=True,
            env=self._host_env(full_env, cwd),
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        self._procs.add(proc)
        cap = self.config.max_output_bytes
        over_cap = asyncio.Event()
        try:
            stdin_task = asyncio.create_task(self._feed(proc, stdin))
            readers = [
                asyncio.create_task(self._read_capped(s, cap, over_cap)) for s in (proc.stdout, proc.stderr)
            ]
            waiter = asyncio.create_task(proc.wait())
            cap_watch = asyncio.create_task(over_cap.wait())
            done, _ = await asyncio.wait(
                {waiter, cap_watch}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            killed = None if waiter in done else ("output_limit" if cap_watch in done else "timeout")
            if killed:
                self._kill(proc)
            await proc.wait()
            cap_watch.cancel()
            stdin_task.cancel()
            (out, out_cut), (err, err_cut) = [await r for r in readers]
        finally:
            self._kill(proc)
            self._procs.discard(proc)
        result = ExecResult(
            exit_code=None if killed else proc.returncode,
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            timed_out=killed == "timeout",
            output_truncated=out_cut or err_cut,
            duration_s=time.perf_counter() - start,
            killed_reason=killed,
        )
        if _dir_size(self.host_workdir) > self.config.disk_mb * 1024 * 1024:
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
    async def _read_capped(
        stream: asyncio.StreamReader, cap: int, over_cap: asyncio.Event
    ) -> tuple[bytes, bool]:
        chunks = []
        size = 0
        while chunk := await stream.read(_READ_CHUNK):
            if size < cap:
                chunks.append(chunk[: cap - size])
            size += len(chunk)
            if size > cap:
                over_cap.set()  # keep draining until the kill lands, so the child never blocks
        return b"".join(chunks), size > cap

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the wrapper's process group (its own session)
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
        shutil.rmtree(self.root, ignore_errors=True)

    def __repr__(self) -> str:
        return f"LocalSandbox({self.id}, {self.wrapper.__class__.__name__}, {self.host_workdir})"
