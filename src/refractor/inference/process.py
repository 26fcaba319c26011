"""A server subprocess (native engine or vLLM): start, wait for /health, log tail, stop its group.

Both engines' launchers use this, so start-up errors look the same (exit code or timeout plus the
server's last log lines) and stopping always takes the whole process group (API server, engine
core, workers). ``die_with_parent`` makes the kernel SIGTERM the server when the process that
started it dies, even by SIGKILL: a Ray actor killed mid-run leaves no orphan server behind.

A server that exited is reported with the error that killed its engine, read from its whole log
(``log_errors``), before its last lines: a dying vLLM server's last lines are its shutdown, while
the engine's traceback lies hundreds of lines above, under the tracebacks of the requests it failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import httpx

from refractor.errors import RefractorUserError

_PR_SET_PDEATHSIG = 1

# vLLM's engine process logs this line, then the traceback of the error that killed it; the API server
# logs one traceback per request failed after it, each ending in EngineDeadError
VLLM_ENGINE_FATAL = "EngineCore encountered a fatal error"
_TRACEBACK = "Traceback (most recent call last):"
# a Python exception line, bare or behind vLLM's "(EngineCore pid=N) ERROR 11-27 04:35:17 [core.py:1512] "
_EXCEPTION_LINE = re.compile(
    r"(?:\([^)]*\) (?:ERROR|CRITICAL) \S+ \S+ \[[^\]]*\] )?"
    r"(?P<exception>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)(?::\s.*)?)"
)


def log_errors(log_lines: Iterable[str]) -> tuple[str | None, str | None]:
    """The errors a server's log names: the exception line that follows vLLM's engine-fatal line (the
    error that killed its engine), and the one that ends the log's last Python traceback; None for
    each the log does not have."""
    after_fatal = in_traceback = False
    engine_error = last_error = None
    for line in log_lines:
        if VLLM_ENGINE_FATAL in line:
            after_fatal, engine_error = True, None
            continue
        if _TRACEBACK in line:
            in_traceback = True
            continue
        match = _EXCEPTION_LINE.fullmatch(line.rstrip())
        if match is None:
            continue
        if after_fatal and engine_error is None:
            engine_error = match["exception"]
        if in_traceback:
            last_error, in_traceback = match["exception"], False
    return engine_error, last_error


class ServerStartError(RefractorUserError, RuntimeError):
    """The server exited or never became healthy; the message ends with its last log lines."""


def raise_open_file_limit(wanted: int = 65536) -> int:
    """Lift this process's soft limit on open files toward its hard limit; the new soft limit.

    Every concurrent request holds a socket on both sides: 1,024 lanes would exhaust the common
    default of 1,024 descriptors, and a server out of descriptors stops accepting connections."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def client_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class ServerProcess:
    """Handle of a running server: ``url``, ``alive()``, ``log_tail()``, ``exit_report()``,
    ``wait_healthy()``, ``stop()``."""

    def __init__(
        self, process: subprocess.Popen, url: str, log_path: Path, what: str, scratch_dir: Path | None = None
    ):
        self.process = process
        self.url = url
        self.log_path = Path(log_path)
        self.what = what
        self.scratch_dir = scratch_dir  # private files of the server, removed when it is stopped

    @classmethod
    def spawn(
        cls,
        argv: list[str],
        *,
        url: str,
        log_path: str | Path,
        what: str,
        env: dict[str, str] | None = None,
        die_with_parent: bool = False,
        scratch_dir: Path | None = None,
    ) -> ServerProcess:
        """Start ``argv`` in its own session (process group), appending its output to ``log_path``.

        ``die_with_parent`` ties the server's life to the calling *thread* (Linux semantics): use it
        from a long-lived thread such as a Ray actor's, not from a short-lived worker thread.
        ``scratch_dir``: a folder the server uses while it runs, removed by ``stop``.
        """
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            process = subprocess.Popen(
                argv,
                env={**os.environ, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent if die_with_parent else None,
            )
        return cls(process, url, log_path, what, scratch_dir)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=lines))
        except OSError:
            return ""

    def exit_report(self, lines: int = 40) -> str:
        """What the log of a server that exited says: the error that killed its engine (vLLM), else
        the last error it logged, then its last ``lines`` lines."""
        try:
            with open(self.log_path, errors="replace") as f:
                engine_error, last_error = log_errors(f)
        except OSError:
            engine_error = last_error = None
        if engine_error:
            head = f"Its engine died of: {engine_error}\n"
        else:
            head = f"The last error in its log: {last_error}\n" if last_error else ""
        return f"{head}Its last log lines ({self.log_path}):\n{self.log_tail(lines)}"

    def wait_healthy(self, timeout_s: float) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise ServerStartError(
                    f"{self.what} at {self.url} exited with code {self.process.returncode} while "
                    f"starting.\n{self.exit_report()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(
                    f"{self.what} at {self.url} was not healthy after {timeout_s:.0f} s; "
                    f"last log lines ({self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server's process group, then SIGKILL whatever is left of it; remove its scratch
        folder."""
        if self.process.poll() is None:
            pgid = self.process.pid  # started with start_new_session: its pid is its group id
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                self.process.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):  # stragglers that ignored SIGTERM
            os.killpg(self.process.pid, signal.SIGKILL)
        if self.scratch_dir is not None:
            shutil.rmtree(self.scratch_dir, ignore_errors=True)
