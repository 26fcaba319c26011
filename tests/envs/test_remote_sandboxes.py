"""Hosted sandbox providers (E2B, Modal, Daytona, Prime) against local fakes of their SDKs.

The services cannot be reached from the test machines, so each SDK is replaced by a fake module
(``sandbox_sdk_fakes.py``) that records the calls crossing the SDK boundary and runs the scripts on
this machine: the adapters are checked for the calls they make and for what a program run through
them returns.
"""

from __future__ import annotations

import asyncio
import shutil
import sys

import pytest
from sandbox_sdk_fakes import FAKES, Machine, Record

from refractor.envs import get_environment, score_rollout
from refractor.envs.data import fixture_path
from refractor.envs.sandbox import SandboxConfig, SandboxError, SandboxPool, get_provider
from refractor.envs.sandbox.remote import ProviderSetupError
from refractor.envs.testing import finished_state
from refractor.errors import RefractorUserError

CREDENTIALS = {
    "e2b": {"E2B_API_KEY": "test-key"},
    "modal": {"MODAL_TOKEN_ID": "id", "MODAL_TOKEN_SECRET": "secret"},
    "daytona": {"DAYTONA_API_KEY": "test-key"},
    "prime": {"PRIME_API_KEY": "test-key"},
}
SDK_MODULE = {"e2b": "e2b", "modal": "modal", "daytona": "daytona", "prime": "prime_sandboxes"}
PROVIDERS = list(CREDENTIALS)


@pytest.fixture
def service(request, monkeypatch, tmp_path):
    """``(provider name, machine)`` with the fake SDK installed and credentials set."""
    name = request.param
    machine = Machine(tmp_path / "service")
    monkeypatch.setitem(sys.modules, SDK_MODULE[name], FAKES[name](machine))
    for var, value in CREDENTIALS[name].items():
        monkeypatch.setenv(var, value)
    return name, machine


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("service", PROVIDERS, indirect=True)
def test_roundtrip_uploads_runs_with_limits_reads_and_destroys(service):
    name, machine = service
    config = SandboxConfig(memory_mb=512, env={"GREETING": "hi"})

    async def main():
        sandbox = await get_provider(name).create(config)
        await sandbox.write_file("main.py", "import os, sys\nprint(os.environ['GREETING'], sys.stdin.read())")
        result = await sandbox.exec(["python", "main.py"], stdin="there", timeout_s=7)
        await sandbox.write_file("out.txt", b"\x00bytes")
        data = await sandbox.read_file("out.txt")
        await sandbox.close()
        await sandbox.close()  # idempotent: one destroy
        return sandbox, result, data

    sandbox, result, data = run(main())
    assert result.ok and result.stdout == "hi there\n"
    assert data == b"\x00bytes"
    assert sandbox.id.startswith(f"{name}-")
    ops = machine.ops()
    assert ops[0] == "create" and ops.count("destroy") == 1 and ops[-1] == "destroy"
    writes = [c for c in machine.calls if c[0] == "write"]
    assert writes[0] == ("write", f"{sandbox.workdir}/main.py", writes[0][2])
    assert any(c[1].startswith(f"{sandbox.workdir}/.stdin-") and c[2] == b"there" for c in writes)
    script, sdk_timeout = next((c[1], c[2]) for c in machine.calls if c[0] == "run" and "main.py" in c[1])
    assert "timeout -k 1 7 " in script and "ulimit -v 524288" in script and "GREETING=hi" in script
    assert 7 < sdk_timeout <= 7 + 10  # the SDK waits a little longer than the in-sandbox limit
    assert not list(machine.host(sandbox.workdir).glob(".stdin-*"))  # the stdin file is removed


@pytest.mark.parametrize("service", PROVIDERS, indirect=True)
def test_nonzero_exit_and_stderr_come_back_separately(service):
    name, machine = service

    async def main():
        sandbox = await get_provider(name).create(SandboxConfig())
        try:
            return await sandbox.exec("echo out; echo err >&2; exit 3", timeout_s=5)
        finally:
            await sandbox.close()

    result = run(main())
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not result.ok and result.killed_reason is None


@pytest.mark.parametrize("service", PROVIDERS, indirect=True)
def test_a_command_past_its_time_limit_is_a_timeout(service):
    name, machine = service

    async def main():
        sandbox = await get_provider(name).create(SandboxConfig())
        try:
            return await sandbox.exec(["sleep", "5"], timeout_s=0.5)
        finally:
            await sandbox.close()

    result = run(main())
    assert result.timed_out and result.killed_reason == "timeout" and result.exit_code is None
    assert machine.ops()[-1] == "destroy"


@pytest.mark.parametrize("service", ["e2b"], indirect=True)
def test_an_sdk_timeout_after_the_limit_is_a_timeout_and_an_early_sdk_error_raises(service):
    name, machine = service

    async def main():
        sandbox = await get_provider(name).create(SandboxConfig())
        machine.fail_next_run = TimeoutError("deadline exceeded")
        machine.delay_s = 0.3
        late = await sandbox.exec(["python", "-c", "pass"], timeout_s=0.2)
        machine.fail_next_run = ConnectionError("service unreachable")
        machine.delay_s = 0.0
        with pytest.raises(SandboxError, match="service unreachable"):
            await sandbox.exec(["python", "-c", "pass"], timeout_s=10)
        await sandbox.close()
        return late

    late = run(main())
    assert late.timed_out and late.killed_reason == "timeout"
    assert machine.ops()[-1] == "destroy"


@pytest.mark.parametrize("service", ["modal"], indirect=True)
def test_output_over_the_cap_is_truncated_and_marked(service):
    name, machine = service
    provider = get_provider(name)

    async def capped():
        sandbox = await provider.create(SandboxConfig(max_output_bytes=1000))
        machine.run_result = (0, "x" * 5000, "")
        try:
            return await sandbox.exec("yes", timeout_s=5)
        finally:
            await sandbox.close()

    result = run(capped())
    assert len(result.stdout) == 1000 and result.output_truncated
    assert result.killed_reason == "output_limit" and result.exit_code is None


@pytest.mark.parametrize("service", PROVIDERS, indirect=True)
def test_paths_outside_the_workdir_are_refused_without_calling_the_service(service):
    name, machine = service

    async def main():
        sandbox = await get_provider(name).create(SandboxConfig())
        calls = len(machine.calls)
        for path in ["/etc/passwd", "../escape.py", "a/../../escape.py"]:
            with pytest.raises(SandboxError, match="outside the sandbox workdir"):
                await sandbox.write_file(path, "x")
        assert len(machine.calls) == calls
        await sandbox.close()
        with pytest.raises(SandboxError, match="closed"):
            await sandbox.exec("true")

    run(main())


@pytest.mark.parametrize("service", PROVIDERS, indirect=True)
def test_a_sandbox_whose_setup_fails_is_destroyed(service):
    name, machine = service
    machine.run_result = (1, "", "read-only file system")

    async def main():
        with pytest.raises(SandboxError, match="mkdir failed"):
            await get_provider(name).create(SandboxConfig())

    run(main())
    assert machine.ops()[-1] == "destroy"


@pytest.mark.parametrize("service", PROVIDERS, indirect=True)
def test_limits_and_image_reach_the_service(service):
    name, machine = service
    config = SandboxConfig(cpu=1.5, memory_mb=1536, disk_mb=2048, timeout_s=900, image="python:3.12-slim")
    run(get_provider(name).create(config))
    created = next(c[1] for c in machine.calls if c[0] == "create")
    if name == "e2b":
        assert created["template"] == "python:3.12-slim" and created["timeout"] == 900
        assert created["allow_internet_access"] is False
    elif name == "modal":
        assert created["image"] == "image:python:3.12-slim" and created["timeout"] == 900
        assert (created["cpu"], created["memory"], created["block_network"]) == (1.5, 1536, True)
    elif name == "daytona":
        resources = created["resources"]
        assert (resources.cpu, resources.memory, resources.disk) == (2, 2, 2)
        assert created["image"] == "python:3.12-slim" and created["auto_stop_interval"] == 0
        assert created["network_block_all"] is True
    else:
        assert (created["cpu_cores"], created["memory_gb"], created["disk_size_gb"]) == (2, 2, 2)
        assert created["docker_image"] == "python:3.12-slim" and created["timeout_minutes"] == 15
        assert [c[0] for c in machine.calls][:3] == ["client", "create", "wait"]


@pytest.mark.parametrize("service", ["daytona"], indirect=True)
def test_i3_code_sizes_its_sandboxes_from_its_kwargs(service):
    """configs/examples/i3_code.yaml's memory_mb and disk_mb reach the service (Daytona counts whole
    GiB, at least one)."""
    name, machine = service
    env = get_environment(
        "i3_code", provider=name, dataset_name=str(fixture_path("code")), memory_mb=512, disk_mb=2048
    )

    async def main():
        await env.prepare_resources()  # the pool starts creating sandboxes
        for _ in range(500):
            if any(c[0] == "create" for c in machine.calls):
                break
            await asyncio.sleep(0.01)
        await env.close()

    run(main())
    resources = next(c[1] for c in machine.calls if c[0] == "create")["resources"]
    assert (resources.memory, resources.disk) == (1, 2)


@pytest.mark.parametrize("service", ["daytona"], indirect=True)
def test_sdk_calls_respect_the_concurrency_limit(service, monkeypatch):
    name, machine = service
    active = 0
    peak = 0
    real_run = machine.run

    async def slow_exec(self, command, timeout=None):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.05)
        active -= 1
        code, out, err = real_run(command, timeout)
        return Record(exit_code=code, result=out + err)

    async def main():
        provider = get_provider(name, max_concurrent_ops=2)
        sandboxes = [await provider.create(SandboxConfig()) for _ in range(4)]
        monkeypatch.setattr(type(sandboxes[0].session.sandbox.process), "exec", slow_exec)
        await asyncio.gather(*(s.exec("true") for s in sandboxes for _ in range(2)))
        await asyncio.gather(*(s.close() for s in sandboxes))

    run(main())
    assert peak == 2


@pytest.mark.parametrize("service", ["prime"], indirect=True)
def test_pool_prewarms_hosted_sandboxes_and_destroys_each_after_use(service):
    name, machine = service

    async def main():
        pool = SandboxPool(get_provider(name), SandboxConfig(), size=2)
        await pool.wait_ready(timeout_s=10)
        sandbox = await pool.acquire()
        await pool.release(sandbox)
        await pool.wait_ready(timeout_s=10)
        await pool.close()

    run(main())
    ops = machine.ops()
    assert ops.count("create") == 3 and ops.count("destroy") == 3


@pytest.mark.parametrize(
    ("name", "variable"),
    [
        ("e2b", "E2B_API_KEY"),
        ("modal", "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET"),
        ("daytona", "DAYTONA_API_KEY"),
        ("prime", "PRIME_API_KEY"),
    ],
)
def test_missing_credentials_is_one_line_naming_the_variable(name, variable, monkeypatch, tmp_path):
    machine = Machine(tmp_path)
    monkeypatch.setitem(sys.modules, SDK_MODULE[name], FAKES[name](machine))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.modal.toml or ~/.prime/config.json
    monkeypatch.delenv("PRIME_CONFIG_DIR", raising=False)
    for var in CREDENTIALS[name]:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ProviderSetupError) as err:
        get_environment("i3_code", provider=name, dataset_name=str(fixture_path("code")))
    message = str(err.value)
    assert "\n" not in message and f"set {variable}" in message and repr(name) in message
    assert isinstance(err.value, RefractorUserError)
    assert machine.calls == []  # nothing reached the service


@pytest.mark.parametrize(
    ("name", "extra"), [("e2b", "e2b"), ("modal", "modal"), ("daytona", "daytona"), ("prime", "prime")]
)
def test_missing_sdk_names_the_extra_to_install(name, extra, monkeypatch):
    monkeypatch.setitem(sys.modules, SDK_MODULE[name], None)  # makes the import fail
    with pytest.raises(ProviderSetupError, match=rf"pip install 'refractor\[{extra}\]'") as err:
        get_provider(name)
    assert "\n" not in str(err.value)


def test_unknown_provider_lists_the_choices_also_when_the_environment_is_built():
    with pytest.raises(ValueError, match="'e2b', 'modal', 'daytona', 'prime'"):
        get_provider("gcp")
    with pytest.raises(ValueError, match="unknown sandbox provider 'gcp'"):
        get_environment("i3_code", provider="gcp", dataset_name=str(fixture_path("code")))


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


COMPLETIONS = [  # (sample index, completion)
    (0, fenced("a, b = map(int, input().split())\nprint(a + b)")),
    (0, fenced("a, b = map(int, input().split())\nprint(a - b)")),
    (
        2,
        fenced(
            "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
            "        for i, n in enumerate(nums):\n"
            "            if target - n in seen: return [seen[target - n], i]\n"
            "            seen[n] = i"
        ),
    ),
    (3, fenced("def add(a, b):\n    return a + b")),
    (1, "no code here"),
]


def rewards(env) -> list[tuple[float, float]]:
    async def main():
        await env.prepare_resources()
        try:
            results = await asyncio.gather(
                *(
                    score_rollout(env, finished_state(env, env.get_sample(i), text), timeout_s=60)
                    for i, text in COMPLETIONS
                )
            )
        finally:
            await env.close()
        assert all(outcome.ok for outcome in results), [outcome.detail for outcome in results]
        return [(o.result.total_reward, o.result.sample_metrics["pass_rate"]) for o in results]

    return run(main())


@pytest.mark.parametrize("service", ["e2b"], indirect=True)
def test_i3_code_on_a_hosted_provider_scores_like_expected(service):
    """The whole code environment through the E2B adapter (scripts run on this machine)."""
    name, machine = service
    env = get_environment(
        "i3_code",
        provider=name,
        dataset_name=str(fixture_path("code")),
        min_difficulty=0.1,
        timeout_per_test=5.0,
        pool_size=2,
    )
    assert rewards(env) == [(1.0, 1.0), (0.0, pytest.approx(1 / 3)), (1.0, 1.0), (1.0, 1.0), (0.0, 0.0)]
    assert machine.ops().count("create") == machine.ops().count("destroy")
    assert machine.ops().count("create") >= 4


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_i3_code_has_the_same_tasks_and_rewards_as_code():
    kwargs = {"dataset_name": str(fixture_path("code")), "min_difficulty": 0.1, "timeout_per_test": 5.0}
    code = get_environment("code", **kwargs)
    i3 = get_environment("i3_code", **kwargs)  # provider defaults to the local bubblewrap sandbox
    assert i3.sandbox_provider == "local"
    assert len(i3) == len(code) and len(code) > 0
    for index in range(len(code)):
        assert i3.get_sample(index).prompt == code.get_sample(index).prompt
        assert i3.get_sample(index).metadata == code.get_sample(index).metadata
    assert rewards(i3) == rewards(code)


def test_i3_code_rejects_unknown_kwargs_like_code():
    with pytest.raises(TypeError):
        get_environment("i3_code", dataset_name=str(fixture_path("code")), sandbox_memory=5)
