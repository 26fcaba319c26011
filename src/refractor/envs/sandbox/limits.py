"""Memory limits for a sandbox's whole process tree, in one of two modes (detected once per process).

* ``cgroup2``: the machine gives us a delegated, writable cgroup v2 subtree with the ``memory`` and
  ``pids`` controllers (our own cgroup, or the directory named by ``REFRACTOR_SANDBOX_CGROUP``). Each
  sandbox gets a cgroup with ``memory.max = memory_mb`` (no swap) and ``pids.max = max_processes``;
  each command runs in a leaf cgroup below it, so the kernel bounds the total of all processes and
  an overrun OOM-kills the command's whole tree. When a command ends its leaf is killed, so nothing
  outlives it, not even processes that left its process group.
* ``rlimit``: no usable cgroup. Every process keeps ``RLIMIT_AS = memory_mb`` and (where the
  provider can count processes) ``RLIMIT_NPROC = max_processes``, so the kernel bounds the tree by
  ``memory_mb * max_processes``; on top of that a watcher sums the proportional set size (PSS) of
  the command's process tree every ``WATCH_INTERVAL_S`` and kills the tree when it passes
  ``memory_mb``. The watcher samples, so the total can overshoot by what the tree allocates
  within one interval.
Either way an overrun is reported as ``ExecResult.killed_reason == "memory_limit"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import uuid
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

CGROUP_VAR = "REFRACTOR_SANDBOX_CGROUP"
WATCH_INTERVAL_S = 0.05
_NEEDED_CONTROLLERS = ("memory", "pids")


class MemoryLimitMode(enum.Enum):
    CGROUP2 = "cgroup2"
    RLIMIT = "rlimit"


def _cgroup2_mount() -> Path | None:
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            fields = line.split()
            if fields[fields.index("-") + 1] == "cgroup2":
                return Path(fields[4])
    return None


def _own_cgroup2_dir() -> Path | None:
    mount = _cgroup2_mount()
    if mount is None:
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return mount / line[3:].lstrip("/")
    return None


def _usable_parent(parent: Path) -> str | None:
    """None when sandbox cgroups can be created under ``parent``; else why not."""
    if not os.access(parent, os.W_OK):
        return f"{parent} is not writable"
    available = (parent / "cgroup.controllers").read_text().split()
    missing = [name for name in _NEEDED_CONTROLLERS if name not in available]
    if missing:
        return f"{parent} lacks the {'/'.join(missing)} controller"
    enabled = (parent / "cgroup.subtree_control").read_text().split()
    if not all(name in enabled for name in _NEEDED_CONTROLLERS):
        try:
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{n}" for n in _NEEDED_CONTROLLERS))
        except OSError as err:  # EBUSY: the cgroup holds processes itself (not a delegated subtree)
            return f"cannot enable memory/pids below {parent}: {err.strerror}"
    probe = parent / f"refractor-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        (probe / "memory.max").write_text(str(64 * 1024 * 1024))
        (probe / "pids.max").write_text("8")
    except OSError as err:
        return f"cannot create a limited cgroup below {parent}: {err.strerror}"
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    return None


_detected: tuple[MemoryLimitMode, Path | None] | None = None


def detect_memory_mode() -> tuple[MemoryLimitMode, Path | None]:
    """The memory-limit mode of this machine and, for cgroup2, the parent of sandbox cgroups."""
    global _detected
    if _detected is not None:
        return _detected
    configured = os.environ.get(CGROUP_VAR)
    parent = Path(configured) if configured else _own_cgroup2_dir()
    try:
        problem = "no cgroup v2 hierarchy is mounted" if parent is None else _usable_parent(parent)
    except OSError as err:
        problem = f"cannot inspect {parent}: {err}"
    if problem is None:
        _detected = (MemoryLimitMode.CGROUP2, parent)
        logger.info("sandbox memory limits: cgroup2 below %s (whole process tree)", parent)
    else:
        _detected = (MemoryLimitMode.RLIMIT, None)
        log = logger.warning if configured else logger.info
        log(
            "sandbox memory limits: rlimit per process plus a process-tree watcher (%s; set %s to a "
            "delegated cgroup v2 directory for kernel-enforced tree limits)",
            problem,
            CGROUP_VAR,
        )
    return _detected


class SandboxCgroup:
    """One sandbox's cgroup: the limits live here, each command runs in a leaf below it."""

    def __init__(self, parent: Path, memory_bytes: int, max_processes: int) -> None:
        self.path = parent / f"refractor-sbx-{uuid.uuid4().hex[:12]}"
        self.path.mkdir()
        (self.path / "memory.max").write_text(str(memory_bytes))
        with contextlib.suppress(FileNotFoundError):  # kernels without swap accounting
            (self.path / "memory.swap.max").write_text("0")
        (self.path / "pids.max").write_text(str(max_processes))

    def new_leaf(self) -> Path:
        leaf = self.path / f"exec-{uuid.uuid4().hex[:8]}"
        leaf.mkdir()
        (leaf / "memory.oom.group").write_text("1")  # an overrun kills the command's whole tree
        return leaf

    def oom_kills(self) -> int:
        for line in (self.path / "memory.events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    @staticmethod
    def enter_prefix(leaf: Path) -> list[str]:
        """argv prefix that moves the command into ``leaf`` before it starts (children follow)."""
        return ["/bin/sh", "-c", 'echo 0 > "$0/cgroup.procs" && exec "$@"', str(leaf)]

    @staticmethod
    async def kill_leaf(leaf: Path) -> None:
        with contextlib.suppress(OSError):
            (leaf / "cgroup.kill").write_text("1")
        for _ in range(200):
            try:
                leaf.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # still has processes: they are dying
                await asyncio.sleep(0.01)
        logger.warning("sandbox cgroup %s still has processes", leaf)

    def remove(self) -> None:
        for leaf in self.path.glob("exec-*"):
            with contextlib.suppress(OSError):
                (leaf / "cgroup.kill").write_text("1")
                leaf.rmdir()
        with contextlib.suppress(OSError):
            self.path.rmdir()


def tree_pss_bytes(root_pid: int) -> int:
    """Proportional set size of a process and all its descendants (shared pages counted once)."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_full_info().pss
    return total


async def watch_tree_memory(root_pid: int, limit_bytes: int) -> None:
    """Returns when the process tree under ``root_pid`` uses more than ``limit_bytes``."""
    while await asyncio.to_thread(tree_pss_bytes, root_pid) <= limit_bytes:
        await asyncio.sleep(WATCH_INTERVAL_S)
