"""Prime Intellect sandboxes through the official ``prime-sandboxes`` SDK
(``pip install 'refractor[prime]'``).

Resources are whole cores and GB (rounded up, at least one); the lifetime is whole minutes. Files
move through the SDK's upload/download calls via a local temporary file.
Credentials: ``PRIME_API_KEY``, ``api_key=``, or the config file ``prime login`` writes.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

from refractor.envs.sandbox.protocol import SandboxConfig
from refractor.envs.sandbox.remote import (
    DEFAULT_IMAGE,
    RawResult,
    RemoteProvider,
    import_sdk,
    require_credentials,
)


class PrimeSession:
    def __init__(self, client, sandbox_id: str) -> None:
        self.client = client
        self.id = str(sandbox_id)

    async def run(self, script: str, timeout_s: float) -> RawResult:
        response = await self.client.execute_command(self.id, script, timeout=math.ceil(timeout_s))
        return RawResult(response.exit_code, response.stdout or "", response.stderr or "")

    async def write(self, path: str, data: bytes) -> None:
        with tempfile.TemporaryDirectory(prefix="refractor-upload-") as folder:
            local = os.path.join(folder, "file")
            Path(local).write_bytes(data)
            await self.client.upload_file(self.id, path, local)

    async def read(self, path: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="refractor-download-") as folder:
            local = os.path.join(folder, "file")
            await self.client.download_file(self.id, path, local)
            return Path(local).read_bytes()

    async def destroy(self) -> None:
        await self.client.delete(self.id)


class PrimeProvider(RemoteProvider):
    name = "prime"
    workdir = "/sandbox-workspace"

    def __init__(self, api_key: str | None = None, max_concurrent_ops: int = 32) -> None:
        super().__init__(max_concurrent_ops)
        self.sdk = import_sdk("prime_sandboxes", self.name, extra="prime")
        config_dir = Path(os.environ.get("PRIME_CONFIG_DIR", Path.home() / ".prime"))
        require_credentials(self.name, ["PRIME_API_KEY"], api_key, [config_dir / "config.json"])
        self.api_key = api_key
        self._client = None  # the SDK's HTTP session belongs to the event loop that opened it

    async def open_session(self, config: SandboxConfig) -> PrimeSession:
        if self._client is None:
            self._client = self.sdk.AsyncSandboxClient(api_key=self.api_key)
        request = self.sdk.CreateSandboxRequest(
            name=config.name or "refractor-sandbox",
            docker_image=config.image or DEFAULT_IMAGE,
            start_command="tail -f /dev/null",
            cpu_cores=max(1, math.ceil(config.cpu)),
            memory_gb=max(1, math.ceil(config.memory_mb / 1024)),
            disk_size_gb=max(1, math.ceil(config.disk_mb / 1024)),
            timeout_minutes=max(1, math.ceil(config.timeout_s / 60)),
            environment_vars=dict(config.env),
        )
        sandbox = await self._client.create(request)
        session = PrimeSession(self._client, sandbox.id)
        try:
            await self._client.wait_for_creation(sandbox.id)
        except BaseException:
            await session.destroy()
            raise
        return session
