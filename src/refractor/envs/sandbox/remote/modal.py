"""Modal sandboxes through the official ``modal`` SDK (``pip install 'refractor[modal]'``).

The SDK's blocking calls run in a thread pool sized to ``max_concurrent_ops``. Sandboxes belong to
the Modal app ``app_name`` (created when missing) and run ``SandboxConfig.image`` from a registry.
Credentials: ``MODAL_TOKEN_ID`` and ``MODAL_TOKEN_SECRET``, or ``~/.modal.toml`` (``modal token new``).
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from refractor.envs.sandbox.protocol import SandboxConfig
from refractor.envs.sandbox.remote import (
    DEFAULT_IMAGE,
    RawResult,
    RemoteProvider,
    import_sdk,
    require_credentials,
)


class ModalSession:
    def __init__(self, provider: ModalProvider, sandbox) -> None:
        self.provider = provider
        self.sandbox = sandbox
        self.id = str(sandbox.object_id)

    async def run(self, script: str, timeout_s: float) -> RawResult:
        def run_blocking() -> RawResult:
            process = self.sandbox.exec("sh", "-c", script, timeout=math.ceil(timeout_s))
            stdout = process.stdout.read()
            stderr = process.stderr.read()
            process.wait()
            return RawResult(process.returncode, stdout, stderr)

        return await self.provider.in_thread(run_blocking)

    async def write(self, path: str, data: bytes) -> None:
        def write_blocking() -> None:
            with self.sandbox.open(path, "wb") as handle:
                handle.write(data)

        await self.provider.in_thread(write_blocking)

    async def read(self, path: str) -> bytes:
        def read_blocking() -> bytes:
            with self.sandbox.open(path, "rb") as handle:
                return handle.read()

        return await self.provider.in_thread(read_blocking)

    async def destroy(self) -> None:
        await self.provider.in_thread(self.sandbox.terminate)


class ModalProvider(RemoteProvider):
    name = "modal"

    def __init__(self, app_name: str = "refractor-sandboxes", max_concurrent_ops: int = 32) -> None:
        super().__init__(max_concurrent_ops)
        self.sdk = import_sdk("modal", self.name, extra="modal")
        require_credentials(
            self.name, ["MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"], None, [Path.home() / ".modal.toml"]
        )
        self.app_name = app_name
        self.threads = ThreadPoolExecutor(max_concurrent_ops, thread_name_prefix="modal-sandbox")
        self._app = None

    async def in_thread(self, function):
        return await asyncio.get_running_loop().run_in_executor(self.threads, function)

    async def open_session(self, config: SandboxConfig) -> ModalSession:
        def create_blocking():
            if self._app is None:
                self._app = self.sdk.App.lookup(self.app_name, create_if_missing=True)
            return self.sdk.Sandbox.create(
                app=self._app,
                image=self.sdk.Image.from_registry(config.image or DEFAULT_IMAGE),
                timeout=int(config.timeout_s),
                cpu=config.cpu,
                memory=config.memory_mb,
                block_network=not config.network,
            )

        return ModalSession(self, await self.in_thread(create_blocking))
