"""An explicit opt-in: run commands as plain subprocesses with rlimits, WITHOUT isolation.

The program can read whatever the current user can read, reach the network and leave
processes that escape its process group. Use it only for trusted code or machines that are
themselves disposable; it refuses to start unless ``allow_unisolated=True`` (or
``REFRACTOR_SANDBOX_ALLOW_UNISOLATED=1``).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from refractor.envs.sandbox.local import LocalSandbox, rlimit_prefix
from refractor.envs.sandbox.protocol import SandboxConfig, SandboxUnavailableError

logger = logging.getLogger(__name__)
ALLOW_VAR = "REFRACTOR_SANDBOX_ALLOW_UNISOLATED"


class UnisolatedProvider:
    name = "unisolated"
    isolated = False

    def __init__(self, allow_unisolated: bool = False, base_dir: str | None = None) -> None:
        if not (allow_unisolated or os.environ.get(ALLOW_VAR) == "1"):
            raise SandboxUnavailableError(
                "the unisolated provider runs untrusted code without any isolation; "
                f"pass allow_unisolated=True (or set {ALLOW_VAR}=1) if that is really what you want"
            )
        logger.warning("sandbox provider 'unisolated': untrusted code runs WITHOUT isolation (rlimits only)")
        self.base_dir = base_dir

    async def create(self, config: SandboxConfig) -> LocalSandbox:
        root = Path(tempfile.mkdtemp(prefix="refractor-unisolated-", dir=self.base_dir))
        sandbox = LocalSandbox(self, config, root, str(root / "work"))
        sandbox.host_workdir.mkdir()
        return sandbox

    def wrap(
        self, sandbox: LocalSandbox, argv: list[str], env: dict[str, str]
    ) -> tuple[list[str], str | None]:
        # RLIMIT_NPROC would count every process of this user on the host, so it is not set here.
        return [*rlimit_prefix(sandbox.config, limit_processes=False), *argv], str(sandbox.host_workdir)
