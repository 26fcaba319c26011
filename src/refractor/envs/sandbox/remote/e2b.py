"""E2B sandboxes through the official ``e2b`` SDK (``pip install 'refractor[e2b]'``).

``SandboxConfig.image`` names an E2B template (built beforehand with the E2B CLI); without one the
service's default template runs. Credentials: ``E2B_API_KEY`` or ``api_key=``.
"""

from __future__ import annotations

from types import ModuleType

from refractor.envs.sandbox.protocol import SandboxConfig
from refractor.envs.sandbox.remote import RawResult, RemoteProvider, import_sdk, require_credentials


class E2BSession:
    def __init__(self, sdk: ModuleType, sandbox: object) -> None:
        self.sdk = sdk
        self.sandbox = sandbox
        self.id = str(sandbox.sandbox_id)

    async def run(self, script: str, timeout_s: float) -> RawResult:
        try:
            result = await self.sandbox.commands.run(script, timeout=timeout_s)
        except self.sdk.CommandExitException as exited:  # the SDK raises on a non-zero exit
            return RawResult(exited.exit_code, exited.stdout, exited.stderr)
        return RawResult(result.exit_code, result.stdout, result.stderr)

    async def write(self, path: str, data: bytes) -> None:
        await self.sandbox.files.write(path, data)

    async def read(self, path: str) -> bytes:
        return bytes(await self.sandbox.files.read(path, format="bytes"))

    async def destroy(self) -> None:
        await self.sandbox.kill()


class E2BProvider(RemoteProvider):
    name = "e2b"

    def __init__(self, api_key: str | None = None, max_concurrent_ops: int = 32) -> None:
        super().__init__(max_concurrent_ops)
        self.sdk = import_sdk("e2b", self.name, extra="e2b")
        require_credentials(self.name, ["E2B_API_KEY"], api_key, [])
        self.api_key = api_key

    async def open_session(self, config: SandboxConfig) -> E2BSession:
        sandbox = await self.sdk.AsyncSandbox.create(
            template=config.image,
            timeout=int(config.timeout_s),
            envs=dict(config.env),
            metadata={"name": config.name or "refractor"},
            allow_internet_access=config.network,
            api_key=self.api_key,
        )
        return E2BSession(self.sdk, sandbox)
