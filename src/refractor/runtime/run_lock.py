"""One writer per run directory: an exclusive ``flock`` on ``<run>/.lock``.

The kernel drops the lock when its process ends, however it ends (exit, Ctrl-C, kill -9), so a
lock left behind by a crash never blocks the next start: "stale" is simply "not held". The file's
text (host, pid, start time) only names the holder in the error a second writer gets. ``flock``
is per host; run directories shared between hosts over NFS are not protected by it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from refractor.errors import RefractorUserError

LOCK_FILE = ".lock"


class RunLockedError(RefractorUserError, RuntimeError):
    """Another live process writes this run directory."""


class RunLock:
    """Held while a process writes a run directory; ``release()`` (or process exit) frees it."""

    def __init__(self, root: Path, fd: int) -> None:
        self.root = root
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, root: str | Path) -> RunLock:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        path = root / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunLockedError(
                f"{root} is in use by another run (pid {holder.get('pid', '?')} on host "
                f"{holder.get('host', '?')}, started {holder.get('started', '?')}): wait for it to end, "
                "stop it, or pick another `--run_name`"
            ) from None
        os.ftruncate(fd, 0)
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.write(fd, json.dumps(holder).encode())
        return cls(root, fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def is_held(root: str | Path) -> bool:
    """Whether a live process on this host holds the lock of run directory ``root`` (read-only:
    it takes a shared lock for an instant and writes nothing)."""
    try:
        fd = os.open(Path(root) / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the shared lock if it was taken


def _read_holder(fd: int) -> dict[str, object]:
    try:
        text = os.pread(fd, 4096, 0).decode()
        holder = json.loads(text)
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}
