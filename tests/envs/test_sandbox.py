"""The local bubblewrap sandbox: real programs try to escape and every attempt must fail."""

import asyncio
import os
import shutil
import uuid
from pathlib import Path

import pytest

from refractor.envs.sandbox import (
    BwrapProvider,
    SandboxConfig,
    SandboxError,
    SandboxPool,
    SandboxUnavailableError,
    UnisolatedProvider,
    get_provider,
)

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)
LIMITS = SandboxConfig(memory_mb=512, disk_mb=32, max_processes=32, cpu_time_s=20, max_output_bytes=100_000)


@pytest.fixture(scope="module")
def provider():
    provider = BwrapProvider()
    provider.probe()
    return provider


def run_in_sandbox(provider, script, config=LIMITS, timeout_s=20.0, keep=None):
    """Run a Python script in a fresh sandbox; returns (result, sandbox)."""

    async def main():
        sandbox = await provider.create(config)
        try:
            await sandbox.write_file("main.py", script)
            result = await sandbox.exec(["python", "main.py"], timeout_s=timeout_s)
            if keep:
                await keep(sandbox)
            return result, sandbox
        finally:
            await sandbox.close()

    return asyncio.run(main())


def processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_roundtrip_stdin_files_and_identity(provider):
    async def main():
        sandbox = await provider.create(LIMITS)
        try:
            await sandbox.write_file("pkg/data.txt", "42")
            result = await sandbox.exec(
                [
                    "python",
                    "-c",
                    "import os,sys; print(open('pkg/data.txt').read(), sys.stdin.read(), os.getcwd());"
                    "open('out.txt','w').write('written')",
                ],
                stdin="from-stdin",
            )
            return result, await sandbox.read_file("out.txt")
        finally:
            await sandbox.close()

    result, out = asyncio.run(main())
    assert result.ok and result.stdout.split() == ["42", "from-stdin", "/sandbox"]
    assert out == b"written"


def test_no_network(provider):
    result, _ = run_in_sandbox(
        provider,
        (
            "import socket\n"
            "for target in [('1.1.1.1', 53), ('127.0.0.1', 22)]:\n"
            "    try:\n"
            "        socket.create_connection(target, timeout=2); print('CONNECTED', target)\n"
            "    except OSError as err: print('blocked', err.errno)\n"
            "try:\n    socket.getaddrinfo('example.com', 80); print('RESOLVED')\n"
            "except OSError: print('no dns')\n"
        ),
    )
    assert "CONNECTED" not in result.stdout and "RESOLVED" not in result.stdout
    assert result.stdout.count("blocked") == 2 and "no dns" in result.stdout


def test_cannot_write_outside_workdir(provider, tmp_path):
    marker = f"escape-{uuid.uuid4().hex}"
    result, _ = run_in_sandbox(
        provider,
        (
            "import os\n"
            f"targets = ['/usr/{marker}', '/etc/{marker}', '/{marker}', '/root/{marker}', "
            f"'{tmp_path}/{marker}',"
            f"           '/proc/{marker}', '/dev/{marker}']\n"
            "for t in targets:\n"
            "    try:\n        open(t, 'w').write('x'); print('WROTE', t)\n"
            "    except OSError as err: print('denied', type(err).__name__)\n"
            f"open('/tmp/{marker}', 'w').write('private tmp is fine')\n"
        ),
    )
    assert "WROTE" not in result.stdout and result.stdout.count("denied") == 7, result
    for root in ("/usr", "/etc", "/", "/root", str(tmp_path), "/tmp"):
        assert not (Path(root) / marker).exists()  # sandbox /tmp is private, host /tmp untouched


def test_cannot_read_other_users_files(provider, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-VALUE")
    result, _ = run_in_sandbox(
        provider,
        (
            "import glob\n"
            f"for path in ['/etc/shadow', '/root/.bashrc', '{secret}', '/proc/1/environ']:\n"
            "    try:\n        print('READ', path, open(path).read()[:40])\n"
            "    except OSError as err: print('denied', path, type(err).__name__)\n"
            "print(sorted(glob.glob('/root/*')), sorted(glob.glob('/home/*')))\n"
        ),
    )
    assert "TOP-SECRET-VALUE" not in result.stdout and "READ /etc/shadow" not in result.stdout
    assert "READ /root/.bashrc" not in result.stdout and result.stdout.count("denied") >= 3


def test_links_out_of_the_workdir_are_refused(provider):
    async def keep(sandbox):
        with pytest.raises(SandboxError, match="leaves the sandbox workdir"):
            await sandbox.read_file("link")
        with pytest.raises(SandboxError, match="leaves the sandbox workdir"):
            await sandbox.write_file("link", "overwrite /etc/hostname?")
        with pytest.raises(SandboxError):
            await sandbox.read_file("../../../etc/passwd")
        with pytest.raises(SandboxError):
            await sandbox.write_file("/etc/passwd", "x")

    result, _ = run_in_sandbox(provider, "import os; os.symlink('/etc/hostname', 'link')", keep=keep)
    assert result.ok


def test_fork_bomb_is_contained_and_cleaned_up(provider):
    marker = f"forkbomb-{uuid.uuid4().hex}"
    result, _ = run_in_sandbox(
        provider,
        (
            f"import os, sys, time\nsys.argv.append('{marker}')\n"
            "while True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n"
        ),
        timeout_s=3,
    )
    assert result.killed_reason == "timeout"
    assert processes_with(marker) == []


def test_memory_bomb_fails_inside(provider):
    result, _ = run_in_sandbox(
        provider, "blocks = []\nwhile True: blocks.append(bytearray(64 * 1024 * 1024))\n"
    )
    assert result.exit_code != 0 and "MemoryError" in result.stderr


def test_infinite_loop_hits_wall_clock_and_cpu_limits(provider):
    result, _ = run_in_sandbox(provider, "while True: pass\n", timeout_s=1)
    assert result.timed_out and result.exit_code is None and result.duration_s < 5
    cpu_limited = SandboxConfig(cpu_time_s=1, memory_mb=512)
    result, _ = run_in_sandbox(provider, "while True: pass\n", config=cpu_limited, timeout_s=30)
    assert not result.timed_out and result.exit_code not in (0, None) and result.duration_s < 10


def test_huge_stdout_is_capped_and_killed(provider):
    result, _ = run_in_sandbox(provider, "while True: print('x' * 10000)\n")
    assert result.killed_reason == "output_limit" and result.output_truncated
    assert len(result.stdout) == LIMITS.max_output_bytes


def test_large_files_are_refused(provider):
    result, _ = run_in_sandbox(
        provider,
        (
            "try:\n    open('big', 'wb').write(b'0' * (40 * 1024 * 1024)); print('WROTE')\n"
            "except OSError as err: print('refused', type(err).__name__)\n"
        ),
    )
    assert "WROTE" not in result.stdout and result.exit_code != 0 or "refused" in result.stdout


def test_background_processes_die_with_the_command_and_on_close(provider):
    marker = f"leftover-{uuid.uuid4().hex}"
    sleeper = ["python", "-c", "import time; time.sleep(1000)", marker]
    script = (
        f"import subprocess, time\nsubprocess.Popen({sleeper!r}, start_new_session=True)\n"
        "time.sleep(0.3)\nprint('spawned')\n"
    )

    async def main():
        sandbox = await provider.create(LIMITS)
        await sandbox.write_file("main.py", script)
        result = await sandbox.exec(["python", "main.py"])
        after_exec = processes_with(marker)
        slow = asyncio.create_task(sandbox.exec(sleeper))
        await asyncio.sleep(0.5)
        during = processes_with(marker)
        await sandbox.close()
        await asyncio.gather(slow, return_exceptions=True)
        return result, after_exec, during, processes_with(marker), sandbox

    result, after_exec, during, after_close, sandbox = asyncio.run(main())
    assert result.stdout.strip() == "spawned" and after_exec == []
    assert during and after_close == []
    assert not sandbox.root.exists()


def test_pool_prewarms_and_gives_fresh_sandboxes(provider):
    async def main():
        pool = SandboxPool(provider, LIMITS, size=3)
        await pool.wait_ready(timeout_s=30)
        ready = pool.num_ready
        first = await pool.acquire()
        await first.write_file("left.txt", "from the previous user")
        await pool.release(first)
        second = await pool.acquire()
        result = await second.exec(["ls"])
        await pool.close()
        return ready, first, second, result

    ready, first, second, result = asyncio.run(main())
    assert ready == 3 and first.id != second.id and "left.txt" not in result.stdout


def test_unisolated_provider_requires_explicit_opt_in(monkeypatch):
    monkeypatch.delenv("REFRACTOR_SANDBOX_ALLOW_UNISOLATED", raising=False)
    with pytest.raises(SandboxUnavailableError, match="without any isolation"):
        UnisolatedProvider()
    provider = get_provider("unisolated", allow_unisolated=True)
    assert not provider.isolated

    async def main():
        sandbox = await provider.create(LIMITS)
        try:
            return await sandbox.exec(["python", "-c", "print(6 * 7)"], timeout_s=10)
        finally:
            await sandbox.close()

    assert asyncio.run(main()).stdout.strip() == "42"


def test_missing_bwrap_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailableError, match="apt-get install"):
        BwrapProvider().probe()


def test_user_namespace_mode_also_isolates(monkeypatch):
    provider = BwrapProvider()
    monkeypatch.setattr(provider, "modes_to_try", lambda: ["user"])
    assert provider.probe() == "user"
    result, _ = run_in_sandbox(
        provider,
        (
            "import socket\ntry:\n"
            "    socket.create_connection(('1.1.1.1', 53), timeout=2); print('CONNECTED')\n"
            "except OSError: print('blocked')\n"
            "for p in ['/etc/shadow', '/usr/x']:\n    try:\n        open(p, 'a'); print('OPENED', p)\n"
            "    except OSError: print('denied')\n"
        ),
    )
    assert result.stdout.split() == ["blocked", "denied", "denied"]


def test_sandbox_lifetime_limit(provider):
    async def main():
        sandbox = await provider.create(SandboxConfig(timeout_s=0.2))
        try:
            assert (await sandbox.exec(["true"])).ok
            await asyncio.sleep(0.3)
            with pytest.raises(SandboxError, match="lifetime limit"):
                await sandbox.exec(["true"])
        finally:
            await sandbox.close()

    asyncio.run(main())
