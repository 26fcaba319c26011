"""Daytona sandboxes through the official ``daytona`` SDK (``pip install 'refractor[daytona]'``).

Resources are whole cores and GiB (rounded up, at least one); auto-stop is off, since the pool
destroys every sandbox after one use. Daytona's ``process.exec`` returns one merged output, so the
script sends stderr to a file and appends it after a random marker, split apart here.
Credentials: ``DAYTONA_API_KEY`` or ``api_key=``.
"""

from __future__ import annotations

import math
import shlex
import uuid

from refractor.envs.sandbox.protocol import SandboxConfig
from refractor.envs.sandbox.remote import (
    DEFAULT_IMAGE,
    RawResult,
    RemoteProvider,
    import_sdk,
    require_credentials,
)


class DaytonaSession:
    def __init__(self, client, sandbox) -> None:
        self.client = client
        self.sandbox = sandbox
        self.id = str(sandbox.id)

    async def run(self, script: str, timeout_s: float) -> RawResult:
        marker = f"--refractor-stderr-{uuid.uuid4().hex}--"
        errors = f"/tmp/.stderr-{uuid.uuid4().hex}"
        wrapped = (
            f"{{ {script} ; }} 2>{errors}; rc=$?; printf '%s' {shlex.quote(marker)}; "
            f"cat {errors}; rm -f {errors}; exit $rc"
        )
        response = await self.sandbox.process.exec(
            f"sh -c {shlex.quote(wrapped)}", timeout=math.ceil(timeout_s)
        )
        stdout, _, stderr = (response.result or "").partition(marker)
        return RawResult(response.exit_code, stdout, stderr)

    async def write(self, path: str, data: bytes) -> None:
        await self.sandbox.fs.upload_file(data, path)

    async def read(self, path: str) -> bytes:
        return bytes(await self.sandbox.fs.download_file(path))

    async def destroy(self) -> None:
        await self.client.delete(self.sandbox)


class DaytonaProvider(RemoteProvider):
    name = "daytona"

    def __init__(self, api_key: str | None = None, max_concurrent_ops: int = 32) -> None:
        super().__init__(max_concurrent_ops)
        self.sdk = import_sdk("daytona", self.name, extra="daytona")
        require_credentials(self.name, ["DAYTONA_API_KEY"], api_key, [])
        self.api_key = api_key
        self._client = None  # the SDK's HTTP session belongs to the event loop that opened it

    async def open_session(self, config: SandboxConfig) -> DaytonaSession:
        if self._client is None:
            self._client = self.sdk.AsyncDaytona(self.sdk.DaytonaConfig(api_key=self.api_key))
        resources = self.sdk.Resources(
            cpu=max(1, math.ceil(config.cpu)),
            memory=max(1, math.ceil(config.memory_mb / 1024)),
            disk=max(1, math.ceil(config.disk_mb / 1024)),
        )
        params = self.sdk.CreateSandboxFromImageParams(
            image=config.image or DEFAULT_IMAGE,
            resources=resources,
            env_vars=dict(config.env),
            auto_stop_interval=0,
            network_block_all=not config.network,
        )
        sandbox = await self._client.create(params, timeout=max(60, math.ceil(config.timeout_s)))
        return DaytonaSession(self._client, sandbox)
