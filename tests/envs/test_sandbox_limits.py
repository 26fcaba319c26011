"""Sandbox limits hold for the whole process tree and while the program runs, not per process or after."""

import asyncio
import shutil
import sys
import uuid

import psutil
import pytest

from refractor.envs.sandbox import BwrapProvider, SandboxConfig, get_provider
from refractor.envs.sandbox.limits import MemoryLimitMode

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
MB = 1024 * 1024


def run_script(provider, script, config, timeout_s=20.0):
    async def main():
        sandbox = await provider.create(config)
        try:
            await sandbox.write_file("main.py", script)
            return await sandbox.exec(["python", "main.py"], timeout_s=timeout_s)
        finally:
            await sandbox.close()

    return asyncio.run(main())


def processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


# Four children each try to hold 300 MB, one after the other; every one fits a 512 MiB per-process
# limit, two together do not.
FOUR_CHILDREN = """
import os, time
pids = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        time.sleep(1.0 * i)
        try:
            block = bytearray(300 * 1024 * 1024)
            print('held', i, flush=True)
            time.sleep(5)
        except MemoryError:
            print('MemoryError', i, flush=True)
        os._exit(0)
    pids.append(pid)
for pid in pids:
    os.waitpid(pid, 0)
print('all children done', flush=True)
"""


@needs_bwrap
def test_memory_limit_covers_the_whole_process_tree():
    provider = BwrapProvider()
    config = SandboxConfig(memory_mb=512, max_processes=16, cpu_time_s=20)
    result = run_script(provider, FOUR_CHILDREN, config)
    held = result.stdout.count("held")
    assert provider.memory_limit_mode in (MemoryLimitMode.CGROUP2, MemoryLimitMode.RLIMIT)
    assert result.killed_reason == "memory_limit" or "MemoryError" in result.stdout, result
    assert "all children done" not in result.stdout or held <= 1, result
    # cgroup2: the kernel never lets two 300 MB blocks coexist; rlimit: the watcher kills the tree
    # when the second one lands, before the third child starts.
    assert held <= (1 if provider.memory_limit_mode is MemoryLimitMode.CGROUP2 else 2), result


@needs_bwrap
def test_writing_past_disk_mb_fails_while_the_program_runs():
    provider = BwrapProvider()
    if provider.disk_limit_mode != "tmpfs":
        pytest.skip("the workdir is a size-limited tmpfs only in bwrap's root mode")
    config = SandboxConfig(disk_mb=32, memory_mb=512)
    script = (
        "for i in range(6):\n"  # 72 MB in 12 MB files, each below the per-file limit
        "    try:\n"
        "        with open(f'part{i}', 'wb') as handle: handle.write(b'0' * (12 * 1024 * 1024))\n"
        "        print('wrote', i, flush=True)\n"
        "    except OSError as err:\n"
        "        print('failed', i, err.strerror, flush=True)\n"
        "        break\n"
    )
    result = run_script(provider, script, config)
    assert "No space left on device" in result.stdout, result
    assert result.stdout.count("wrote") == 2 and result.killed_reason is None, result


def test_unisolated_timeout_holds_when_a_detached_child_keeps_the_output_open():
    provider = get_provider("unisolated", allow_unisolated=True)
    marker = f"sleeper-{uuid.uuid4().hex}"
    sleeper = f"{sys.executable} -c 'import time; time.sleep(30)' {marker}"

    async def main():
        sandbox = await provider.create(SandboxConfig())
        try:
            background = await sandbox.exec(f"setsid {sleeper} & echo hi", timeout_s=2)
            left_after_exit = processes_with(marker)
            blocking = await sandbox.exec(f"setsid {sleeper} & {sleeper}", timeout_s=2)
            return background, left_after_exit, blocking, processes_with(marker)
        finally:
            await sandbox.close()

    background, left_after_exit, blocking, left_after_timeout = asyncio.run(main())
    assert background.stdout.strip() == "hi" and background.exit_code == 0, background
    assert background.duration_s < 20 and left_after_exit == []
    assert blocking.timed_out and blocking.duration_s < 20 and left_after_timeout == [], blocking
