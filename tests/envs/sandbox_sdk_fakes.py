"""Fakes of the hosted sandbox SDKs (``e2b``, ``modal``, ``daytona``, ``prime_sandboxes``).

Each fake is a module to put in ``sys.modules`` under the SDK's import name. It has the SDK's names
and call shapes that the adapters use, records every call that crosses that boundary on a
``Machine``, and runs the scripts it is sent on this machine under a temporary root standing for the
sandbox's filesystem.
"""

from __future__ import annotations

import subprocess
import time
import types
import uuid
from pathlib import Path


class Machine:
    """The service side of the fakes: a filesystem under ``root`` and a shell that runs scripts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.calls: list[tuple] = []
        self.fail_next_run: Exception | None = None
        self.delay_s = 0.0  # how long a failing run takes before it raises
        self.run_result: tuple[int | None, str, str] | None = None  # replaces running the script

    def host(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def remap(self, script: str) -> str:
        for base in ("/tmp/refractor-work", "/sandbox-workspace"):
            script = script.replace(base, str(self.host(base)))
        return script

    def run(self, script: str, timeout: float) -> tuple[int | None, str, str]:
        self.calls.append(("run", script, timeout))
        if self.fail_next_run is not None:
            err, self.fail_next_run = self.fail_next_run, None
            time.sleep(self.delay_s)
            raise err
        if self.run_result is not None:
            return self.run_result
        done = subprocess.run(
            ["sh", "-c", self.remap(script)], capture_output=True, text=True, timeout=timeout
        )
        return done.returncode, done.stdout, done.stderr

    def write(self, path: str, data: bytes) -> None:
        self.calls.append(("write", path, bytes(data)))
        self.host(path).parent.mkdir(parents=True, exist_ok=True)
        self.host(path).write_bytes(data)

    def read(self, path: str) -> bytes:
        self.calls.append(("read", path))
        return self.host(path).read_bytes()

    def ops(self) -> list[str]:
        """The sandbox operations, without the SDK's client and app set-up calls."""
        return [call[0] for call in self.calls if call[0] in ("create", "write", "run", "read", "destroy")]


class Record:
    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)


def fake_e2b(machine: Machine) -> types.ModuleType:
    sdk = types.ModuleType("e2b")

    class CommandExitException(Exception):
        def __init__(self, exit_code: int, stdout: str, stderr: str) -> None:
            super().__init__(f"exit {exit_code}")
            self.exit_code, self.stdout, self.stderr = exit_code, stdout, stderr

    class Files:
        async def write(self, path: str, data: bytes) -> None:
            machine.write(path, data)

        async def read(self, path: str, format: str = "text"):
            assert format == "bytes"
            return bytearray(machine.read(path))

    class Commands:
        async def run(self, cmd: str, timeout: float = 60):
            code, out, err = machine.run(cmd, timeout)
            if code != 0:
                raise CommandExitException(code, out, err)
            return Record(exit_code=code, stdout=out, stderr=err, error=None)

    class AsyncSandbox:
        def __init__(self) -> None:
            self.sandbox_id = f"sbx-{uuid.uuid4().hex[:6]}"
            self.files = Files()
            self.commands = Commands()

        @classmethod
        async def create(cls, **kwargs):
            machine.calls.append(("create", kwargs))
            return cls()

        async def kill(self) -> bool:
            machine.calls.append(("destroy", self.sandbox_id))
            return True

    sdk.AsyncSandbox = AsyncSandbox
    sdk.CommandExitException = CommandExitException
    return sdk


def fake_modal(machine: Machine) -> types.ModuleType:
    sdk = types.ModuleType("modal")

    class Stream:
        def __init__(self, text: str) -> None:
            self.text = text

        def read(self) -> str:
            return self.text

    class Handle:
        def __init__(self, path: str, mode: str) -> None:
            self.path, self.mode = path, mode

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

        def write(self, data: bytes) -> None:
            machine.write(self.path, data)

        def read(self) -> bytes:
            return machine.read(self.path)

    class Sandbox:
        def __init__(self) -> None:
            self.object_id = f"sb-{uuid.uuid4().hex[:6]}"

        @classmethod
        def create(cls, **kwargs):
            machine.calls.append(("create", kwargs))
            return cls()

        def exec(self, *args: str, timeout: int):
            assert args[:2] == ("sh", "-c")
            code, out, err = machine.run(args[2], timeout)
            process = Record(stdout=Stream(out), stderr=Stream(err), returncode=None)
            process.wait = lambda: setattr(process, "returncode", code)
            return process

        def open(self, path: str, mode: str) -> Handle:
            return Handle(path, mode)

        def terminate(self) -> None:
            machine.calls.append(("destroy", self.object_id))

    sdk.Sandbox = Sandbox
    sdk.App = Record(lookup=lambda name, create_if_missing: machine.calls.append(("app", name)) or name)
    sdk.Image = Record(from_registry=lambda tag: f"image:{tag}")
    return sdk


def fake_daytona(machine: Machine) -> types.ModuleType:
    sdk = types.ModuleType("daytona")

    class FileSystem:
        async def upload_file(self, data: bytes, path: str) -> None:
            machine.write(path, data)

        async def download_file(self, path: str) -> bytes:
            return machine.read(path)

    class Process:
        async def exec(self, command: str, timeout: int | None = None):
            code, out, err = machine.run(command, timeout)
            return Record(exit_code=code, result=out + err)  # the service merges the two streams

    class AsyncDaytona:
        def __init__(self, config) -> None:
            machine.calls.append(("client", config.api_key))

        async def create(self, params, timeout: float = 60):
            machine.calls.append(("create", {**params.__dict__, "timeout": timeout}))
            return Record(id=f"dt-{uuid.uuid4().hex[:6]}", fs=FileSystem(), process=Process())

        async def delete(self, sandbox) -> None:
            machine.calls.append(("destroy", sandbox.id))

    sdk.AsyncDaytona = AsyncDaytona
    sdk.DaytonaConfig = Record
    sdk.Resources = Record
    sdk.CreateSandboxFromImageParams = Record
    return sdk


def fake_prime(machine: Machine) -> types.ModuleType:
    sdk = types.ModuleType("prime_sandboxes")

    class AsyncSandboxClient:
        def __init__(self, api_key: str | None = None) -> None:
            machine.calls.append(("client", api_key))

        async def create(self, request):
            machine.calls.append(("create", request.__dict__))
            return Record(id=f"pr-{uuid.uuid4().hex[:6]}")

        async def wait_for_creation(self, sandbox_id: str) -> None:
            machine.calls.append(("wait", sandbox_id))

        async def execute_command(self, sandbox_id: str, command: str, timeout: int | None = None):
            code, out, err = machine.run(command, timeout)
            return Record(exit_code=code, stdout=out, stderr=err)

        async def upload_file(self, sandbox_id: str, file_path: str, local_file_path: str) -> None:
            machine.write(file_path, Path(local_file_path).read_bytes())

        async def download_file(self, sandbox_id: str, file_path: str, local_file_path: str) -> None:
            Path(local_file_path).write_bytes(machine.read(file_path))

        async def delete(self, sandbox_id: str) -> None:
            machine.calls.append(("destroy", sandbox_id))

    sdk.AsyncSandboxClient = AsyncSandboxClient
    sdk.CreateSandboxRequest = Record
    return sdk


FAKES = {"e2b": fake_e2b, "modal": fake_modal, "daytona": fake_daytona, "prime": fake_prime}
