"""Sandboxes for untrusted code: a provider protocol, an isolated local provider on bubblewrap, an
explicit opt-in unisolated provider, and a pre-warming pool.

    provider = get_provider("auto")                  # bwrap, or a clear error saying why not
    async with open_sandbox(provider, SandboxConfig(memory_mb=512)) as sandbox:
        await sandbox.write_file("main.py", code)
        result = await sandbox.exec(["python", "main.py"], stdin="1 2\\n", timeout_s=10)
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import AsyncIterator
from typing import Any

from refractor.envs.sandbox.bwrap import BwrapProvider
from refractor.envs.sandbox.limits import MemoryLimitMode
from refractor.envs.sandbox.pool import SandboxPool
from refractor.envs.sandbox.protocol import (
    ExecResult,
    Sandbox,
    SandboxClosedError,
    SandboxConfig,
    SandboxError,
    SandboxProvider,
    SandboxUnavailableError,
)
from refractor.envs.sandbox.unisolated import UnisolatedProvider


def get_provider(name: str = "auto", **kwargs: Any) -> SandboxProvider:
    """``bwrap`` (isolated, local), ``unisolated`` (explicit opt-in), ``auto`` (bwrap; the unisolated
    provider only when ``allow_unisolated=True`` and bwrap cannot work), or ``module.Class``."""
    if name in ("bwrap", "local"):
        return BwrapProvider(**kwargs)
    if name == "unisolated":
        return UnisolatedProvider(**kwargs)
    if name == "auto":
        allow = kwargs.pop("allow_unisolated", False)
        provider = BwrapProvider(**kwargs)
        try:
            provider.probe()
            return provider
        except SandboxUnavailableError:
            if not allow:
                raise
            return UnisolatedProvider(allow_unisolated=True, base_dir=kwargs.get("base_dir"))
    if "." in name:
        module, _, cls = name.rpartition(".")
        return getattr(importlib.import_module(module), cls)(**kwargs)
    raise ValueError(
        f"unknown sandbox provider {name!r}: use 'auto', 'bwrap', 'unisolated' or 'package.module.Class'"
    )


@contextlib.asynccontextmanager
async def open_sandbox(
    provider: SandboxProvider, config: SandboxConfig | None = None
) -> AsyncIterator[Sandbox]:
    sandbox = await provider.create(config or SandboxConfig())
    try:
        yield sandbox
    finally:
        await sandbox.close()


__all__ = [
    "BwrapProvider",
    "ExecResult",
    "MemoryLimitMode",
    "Sandbox",
    "SandboxClosedError",
    "SandboxConfig",
    "SandboxError",
    "SandboxPool",
    "SandboxProvider",
    "SandboxUnavailableError",
    "UnisolatedProvider",
    "get_provider",
    "open_sandbox",
]
