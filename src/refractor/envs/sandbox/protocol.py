"""The sandbox protocol: what an environment may ask of a place that runs untrusted code.

A provider ``create``s sandboxes from a ``SandboxConfig`` (limits); a ``Sandbox`` runs commands
(``exec`` with stdin and a wall-clock timeout), moves files in and out of its private working
directory, and is ``close``d (every process it started is killed, its files removed).
Paths given to ``write_file``/``read_file`` are relative to the working directory.
Remote providers (E2B, Modal, Daytona, ...) implement the same two classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class SandboxError(RuntimeError):
    """A sandbox could not do what was asked (infrastructure, not the user program)."""


class SandboxUnavailableError(SandboxError):
    """No isolated sandbox can be created on this machine (and unisolated runs were not allowed)."""


class SandboxClosedError(SandboxError):
    pass


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandbox. The local providers enforce memory and processes for the whole process
    tree (a cgroup, or rlimits plus a watcher: see ``limits.py``) and disk with size-limited tmpfs or
    rlimits (see ``bwrap.py``); remote providers map them to their own resources (``image``/``extra``
    are for those)."""

    cpu: float = 1.0  # cores (remote providers); locally only CPU time is limited
    memory_mb: int = 1024  # all processes of a command together (and each process's address space)
    disk_mb: int = 256  # largest file, size of /tmp, and total size of the workdir
    max_processes: int = 64  # processes/threads of the sandbox user (fork bombs stop here)
    max_open_files: int = 256
    cpu_time_s: int = 60  # CPU seconds of each process
    timeout_s: float = 3600.0  # lifetime of the sandbox
    max_output_bytes: int = 1_000_000  # per stream, per exec; more kills the command
    env: dict[str, str] = field(default_factory=dict)
    network: bool = False
    image: str | None = None
    name: str = ""
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class ExecResult:
    exit_code: int | None  # None when the command was killed by us (timeout, output cap)
    stdout: str
    stderr: str
    timed_out: bool = False
    output_truncated: bool = False
    duration_s: float = 0.0
    killed_reason: str | None = None  # "timeout" | "output_limit" | "memory_limit" | "disk_limit"

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None


@runtime_checkable
class Sandbox(Protocol):
    id: str
    workdir: str  # the working directory as commands inside see it

    async def exec(
        self,
        command: list[str] | str,
        *,
        stdin: bytes | str | None = None,
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> ExecResult: ...

    async def write_file(self, path: str, content: bytes | str) -> None: ...

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes: ...

    async def close(self) -> None: ...


@runtime_checkable
class SandboxProvider(Protocol):
    name: str
    isolated: bool  # False only for the explicit opt-in unisolated provider

    async def create(self, config: SandboxConfig) -> Sandbox: ...
