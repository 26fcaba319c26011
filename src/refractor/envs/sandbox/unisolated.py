"""An explicit opt-in: run commands as plain subprocesses with rlimits, WITHOUT isolation.

The program can read whatever the current user can read and reach the network. Use it only for
trusted code or machines that are themselves disposable. It refuses to start unless
``allow_unisolated=True`` (or ``REFRACTOR_SANDBOX_ALLOW_UNISOLATED=1``).

Limits: memory as in ``limits.py`` (a cgroup when the machine delegates one, else ``RLIMIT_AS`` per
process and the process-tree watcher, with no process-count limit, since ``RLIMIT_NPROC`` would
count every process of this user); disk only per file (``RLIMIT_FSIZE``), the workdir's total is
checked after each command. Every command runs in its own session under a subreaper
(``reaper.py``) that inherits processes detaching from it; everything the command started is
killed when it ends or times out, so a background child holding the output open cannot stall
``exec`` or outlive it.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

from refractor.envs.sandbox import reaper
from refractor.envs.sandbox.limits import MemoryLimitMode, detect_memory_mode
from refractor.envs.sandbox.local import LocalSandbox, rlimit_prefix
from refractor.envs.sandbox.protocol import SandboxConfig, SandboxUnavailableError

logger = logging.getLogger(__name__)
ALLOW_VAR = "REFRACTOR_SANDBOX_ALLOW_UNISOLATED"


class UnisolatedProvider:
    name = "unisolated"
    isolated = False
    disk_limit_mode = "rlimit"

    def __init__(self, allow_unisolated: bool = False, base_dir: str | None = None) -> None:
        if not (allow_unisolated or os.environ.get(ALLOW_VAR) == "1"):
            raise SandboxUnavailableError(
                "the unisolated provider runs untrusted code without any isolation; "
                f"pass allow_unisolated=True (or set {ALLOW_VAR}=1) if that is really what you want"
            )
        logger.warning("sandbox provider 'unisolated': untrusted code runs WITHOUT isolation (rlimits only)")
        self.base_dir = base_dir

    @property
    def memory_limit_mode(self) -> MemoryLimitMode:
        return detect_memory_mode()[0]

    async def create(self, config: SandboxConfig) -> LocalSandbox:
        root = Path(tempfile.mkdtemp(prefix="refractor-unisolated-", dir=self.base_dir))
        sandbox = LocalSandbox(self, config, root, str(root / "work"))
        sandbox.host_workdir.mkdir()
        return sandbox

    def wrap(
        self, sandbox: LocalSandbox, argv: list[str], env: dict[str, str]
    ) -> tuple[list[str], str | None]:
        # RLIMIT_NPROC would count every process of this user on the host, so it is not set here.
        limits = rlimit_prefix(sandbox.config, limit_processes=False)
        return [*limits, sys.executable, reaper.__file__, *argv], str(sandbox.host_workdir)
