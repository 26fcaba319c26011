"""Reward worker processes: a call that overruns its timeout is killed, the others go on."""

import asyncio
import time

import pytest

from refractor.envs.runners import ProcessRunner


def test_process_runner_timeouts_kill_only_the_runaway_call():
    runner = ProcessRunner(processes=2)

    async def main():
        slow = asyncio.ensure_future(runner.run(time.sleep, 30, timeout_s=0.5))
        fast = await runner.run(pow, 2, 10, timeout_s=20)
        with pytest.raises(TimeoutError, match="sleep took longer"):
            await slow
        with pytest.raises(ValueError):
            await runner.run(int, "not a number", timeout_s=20)
        return fast, await runner.run(pow, 3, 3, timeout_s=20)

    try:
        assert asyncio.run(main()) == (1024, 27)
    finally:
        runner.close()
