"""Sandboxes for untrusted code: a provider protocol, an isolated local provider on bubblewrap, an
explicit opt-in unisolated provider, adapters for hosted services (``remote/``), and a pre-warming
pool.

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

REMOTE_PROVIDERS = {  # hosted services; their SDKs are optional extras (see ``remote/``)
    "e2b": "refractor.envs.sandbox.remote.e2b:E2BProvider",
    "modal": "refractor.envs.sandbox.remote.modal:ModalProvider",
    "daytona": "refractor.envs.sandbox.remote.daytona:DaytonaProvider",
    "prime": "refractor.envs.sandbox.remote.prime:PrimeProvider",
}


def get_provider(name: str = "auto", **kwargs: Any) -> SandboxProvider:
    """``bwrap`` (isolated, local), ``unisolated`` (explicit opt-in), ``auto`` or ``local`` (bwrap; the
    unisolated provider only when ``allow_unisolated=True`` and bwrap cannot work), a hosted service
    (``e2b``, ``modal``, ``daytona``, ``prime``), or ``module.Class``."""
    if name == "bwrap":
        return BwrapProvider(**kwargs)
    if name == "unisolated":
        return UnisolatedProvider(**kwargs)
    if name in REMOTE_PROVIDERS:
        module, _, cls = REMOTE_PROVIDERS[name].partition(":")
        return getattr(importlib.import_module(module), cls)(**kwargs)
    if name in ("auto", "local"):
        allow = kwargs.pop("allow_unisolated", False)
        provider = BwrapProvider(**kwargs)
        try:
            provider.probe()
            return provider
        except SandboxUnavailableError:
            if not allow:
                raise
            return UnisolatedProvider(allow_unisolated=True, base_dir=kwargs.get("base_dir"))
    check_provider_name(name)  # what is left is a 'package.module.Class'
    module, _, cls = name.rpartition(".")
    return getattr(importlib.import_module(module), cls)(**kwargs)


def check_provider_name(name: str) -> None:
    """Raises for a name ``get_provider`` does not know, without building anything."""
    if name in ("auto", "local", "bwrap", "unisolated") or name in REMOTE_PROVIDERS or "." in name:
        return
    raise ValueError(
        f"unknown sandbox provider {name!r}: use 'local' (= 'auto'), 'bwrap', 'unisolated', "
        f"{', '.join(repr(p) for p in REMOTE_PROVIDERS)} or 'package.module.Class'"
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
    "REMOTE_PROVIDERS",
    "MemoryLimitMode",
    "Sandbox",
    "SandboxClosedError",
    "SandboxConfig",
    "SandboxError",
    "SandboxPool",
    "SandboxProvider",
    "SandboxUnavailableError",
    "UnisolatedProvider",
    "check_provider_name",
    "get_provider",
    "open_sandbox",
]
