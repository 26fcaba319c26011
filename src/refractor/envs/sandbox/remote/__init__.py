"""Sandboxes on hosted services (E2B, Modal, Daytona, Prime Intellect) behind the sandbox protocol.

Each service's adapter (``e2b.py``, ``modal.py``, ``daytona.py``, ``prime.py``) only translates five
calls to its official SDK: open a sandbox, write a file, read a file, run one shell script with a
timeout, destroy. ``RemoteSandbox`` builds everything else on top, the same for every service:
paths confined to the working directory, stdin through a file, limits applied inside the sandbox
(``timeout`` for the wall clock, ``ulimit -v`` for memory), output caps, the sandbox's lifetime,
and an SDK call limit shared by all sandboxes of one provider. SDKs are optional extras, imported
when a provider is built, and missing credentials fail there with one line naming the variable.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import posixpath
import shlex
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol, TypeVar

from refractor.envs.sandbox.protocol import (
    ExecResult,
    SandboxClosedError,
    SandboxConfig,
    SandboxError,
    SandboxUnavailableError,
)
from refractor.errors import RefractorUserError

logger = logging.getLogger(__name__)

DEFAULT_IMAGE = "amancevice/pandas:slim"  # Python with the scientific stack that coding tasks import
_TIMEOUT_EXIT = 124  # coreutils ``timeout``: the command ran out of time
_KILLED_EXIT = 137  # killed by SIGKILL (``timeout -k`` escalation)
_SDK_GRACE_S = 10.0  # the SDK call outlives the in-sandbox timeout by this much
T = TypeVar("T")


class ProviderSetupError(RefractorUserError, SandboxUnavailableError):
    """A hosted provider cannot start here: its SDK is not installed or no credentials are set."""


def import_sdk(module: str, provider: str, extra: str) -> ModuleType:
    """The provider's SDK module, or one line saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ProviderSetupError(
            f"sandbox provider {provider!r} needs the {module!r} package: pip install 'refractor[{extra}]'"
        ) from err


def require_credentials(provider: str, variables: list[str], explicit: str | None, files: list[Path]) -> None:
    """Fail before any network call when none of the places the SDK reads credentials from is set."""
    if explicit or all(os.environ.get(v) for v in variables) or any(f.exists() for f in files):
        return
    where = " and ".join(variables)
    also = f" (or create {files[0]})" if files else ""
    raise ProviderSetupError(f"sandbox provider {provider!r} has no credentials: set {where}{also}")


@dataclass
class RawResult:
    """What one script run returned, as the service reported it."""

    exit_code: int | None
    stdout: str
    stderr: str


class RemoteSession(Protocol):
    """One sandbox on a service, as its SDK exposes it (paths are absolute)."""

    id: str

    async def run(self, script: str, timeout_s: float) -> RawResult: ...

    async def write(self, path: str, data: bytes) -> None: ...

    async def read(self, path: str) -> bytes: ...

    async def destroy(self) -> None: ...


class RemoteProvider:
    """Base of the hosted providers: ``open_session`` is the only thing an adapter must add."""

    name = "remote"
    isolated = True
    workdir = "/tmp/refractor-work"

    def __init__(self, max_concurrent_ops: int = 32) -> None:
        if max_concurrent_ops < 1:
            raise ValueError(f"max_concurrent_ops must be >= 1, got {max_concurrent_ops}")
        self.max_concurrent_ops = max_concurrent_ops
        self.ops = asyncio.Semaphore(max_concurrent_ops)

    async def open_session(self, config: SandboxConfig) -> RemoteSession:
        raise NotImplementedError

    async def create(self, config: SandboxConfig) -> RemoteSandbox:
        async with self.ops:
            session = await self.open_session(config)
        sandbox = RemoteSandbox(self, session, config, f"{self.workdir}/{uuid.uuid4().hex[:12]}")
        try:
            result = await sandbox.call(session.run(f"mkdir -p {shlex.quote(sandbox.workdir)}", 60.0))
            if result.exit_code != 0:
                raise SandboxError(f"{self.name} sandbox {session.id}: mkdir failed: {result.stderr[-300:]}")
        except BaseException:
            await sandbox.close()
            raise
        return sandbox


def _cap(text: str, limit: int) -> tuple[str, bool]:
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text, False
    return data[:limit].decode("utf-8", "replace"), True


class RemoteSandbox:
    def __init__(
        self, provider: RemoteProvider, session: RemoteSession, config: SandboxConfig, workdir: str
    ) -> None:
        self.provider = provider
        self.session = session
        self.config = config
        self.id = f"{provider.name}-{session.id}"
        self.workdir = workdir
        self.created_at = time.monotonic()
        self._closed = False

    @property
    def age_s(self) -> float:
        return time.monotonic() - self.created_at

    async def call(self, operation: Awaitable[T]) -> T:
        """One SDK call under the provider's concurrency limit."""
        async with self.provider.ops:
            return await operation

    def _path(self, path: str) -> str:
        rel = path[len(self.workdir) :].lstrip("/") if path.startswith(self.workdir + "/") else path
        normal = posixpath.normpath(rel)
        if posixpath.isabs(rel) or normal == ".." or normal.startswith("../"):
            raise SandboxError(f"{self.id}: path {path!r} is outside the sandbox workdir {self.workdir}")
        return f"{self.workdir}/{normal}"

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxClosedError(f"sandbox {self.id} is closed")
        if self.age_s > self.config.timeout_s:
            raise SandboxError(
                f"sandbox {self.id} reached its lifetime limit (timeout_s={self.config.timeout_s:g})"
            )

    async def write_file(self, path: str, content: bytes | str) -> None:
        self._check_open()
        data = content.encode() if isinstance(content, str) else content
        await self.call(self.session.write(self._path(path), data))

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        self._check_open()
        data = await self.call(self.session.read(self._path(path)))
        return bytes(data[: max_bytes if max_bytes is not None else self.config.max_output_bytes])

    def script(
        self, command: list[str] | str, stdin_path: str | None, timeout_s: float, env: dict[str, str]
    ) -> str:
        """The shell line that runs ``command`` in the workdir with the limits of the config."""
        program = command if isinstance(command, str) else shlex.join(command)
        inner = f"ulimit -v {self.config.memory_mb * 1024} 2>/dev/null; {program}"
        assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        source = shlex.quote(stdin_path) if stdin_path else "/dev/null"
        line = (
            f"cd {shlex.quote(self.workdir)} && env {assignments} "
            f"timeout -k 1 {timeout_s:g} sh -c {shlex.quote(inner)} < {source}"
        )
        if stdin_path:
            line += f"; rc=$?; rm -f {shlex.quote(stdin_path)}; exit $rc"
        return line

    async def exec(
        self,
        command: list[str] | str,
        *,
        stdin: bytes | str | None = None,
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        self._check_open()
        stdin_path = None
        if stdin is not None:
            stdin_path = f"{self.workdir}/.stdin-{uuid.uuid4().hex[:12]}"
            await self.write_file(stdin_path, stdin)
        script = self.script(command, stdin_path, timeout_s, {**self.config.env, **(env or {})})
        start = time.perf_counter()
        try:
            raw = await self.call(self.session.run(script, timeout_s + _SDK_GRACE_S))
        except Exception as err:
            elapsed = time.perf_counter() - start
            if elapsed < timeout_s:
                raise SandboxError(f"{self.id}: command failed in the service: {err}") from err
            raw = RawResult(None, "", "")  # the SDK gave up after the command's own time limit
        duration = time.perf_counter() - start
        out_of_time = raw.exit_code in (None, _KILLED_EXIT) and duration >= timeout_s
        timed_out = raw.exit_code == _TIMEOUT_EXIT or out_of_time
        stdout, out_cut = _cap(raw.stdout, self.config.max_output_bytes)
        stderr, err_cut = _cap(raw.stderr, self.config.max_output_bytes)
        killed = "timeout" if timed_out else "output_limit" if out_cut or err_cut else None
        return ExecResult(
            exit_code=None if killed else raw.exit_code,
            stdout=stdout,
            stderr=stderr,
            timed_out=timed_out,
            output_truncated=out_cut or err_cut,
            duration_s=duration,
            killed_reason=killed,
        )

    async def close(self) -> None:
        """Destroys the sandbox on the service; a failure is logged (the service's lifetime limit
        removes it anyway), never raised into the reward that released it."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.call(self.session.destroy())
        except Exception as err:
            logger.warning("could not destroy %s (%s: %s)", self.id, type(err).__name__, err)

    def __repr__(self) -> str:
        return f"RemoteSandbox({self.id}, {self.workdir})"


__all__ = [
    "DEFAULT_IMAGE",
    "ProviderSetupError",
    "RawResult",
    "RemoteProvider",
    "RemoteSandbox",
    "RemoteSession",
]
