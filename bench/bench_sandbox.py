"""Sandboxed test executions per second (CPU only; not asserted).

Measures `sandbox.exec(["python", "solution.py"], stdin=...)` for a small stdin program: the bubblewrap
sandbox (namespaces + setpriv + prlimit) against the unisolated provider (prlimit only) as the baseline,
sequentially and with several concurrent execs, plus the full `code` environment reward (3 tests per
rollout) end to end. Run: `python bench/bench_sandbox.py [--seconds 5]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from refractor.envs import get_environment, score_rollout
from refractor.envs.data import fixture_path
from refractor.envs.sandbox import BwrapProvider, SandboxConfig, UnisolatedProvider
from refractor.envs.testing import finished_state

PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"


async def execs_per_second(provider, concurrency: int, seconds: float) -> float:
    sandboxes = [await provider.create(SandboxConfig()) for _ in range(concurrency)]
    for sandbox in sandboxes:
        await sandbox.write_file("solution.py", PROGRAM)
    count = 0
    deadline = time.perf_counter() + seconds

    async def worker(sandbox) -> None:
        nonlocal count
        while time.perf_counter() < deadline:
            result = await sandbox.exec(["python", "solution.py"], stdin="20 22\n", timeout_s=10)
            assert result.stdout.strip() == "42", result
            count += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(s) for s in sandboxes))
    elapsed = time.perf_counter() - start
    await asyncio.gather(*(s.close() for s in sandboxes))
    return count / elapsed


async def rewards_per_second(concurrency: int, seconds: float) -> float:
    env = get_environment("code", dataset_name=str(fixture_path("code")), pool_size=concurrency)
    sample = env.get_sample(0)
    completion = f"```python\n{PROGRAM}```"
    await env.prepare_resources()
    count = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal count
        while time.perf_counter() < deadline:
            outcome = await score_rollout(env, finished_state(env, sample, completion), timeout_s=60)
            assert outcome.ok and outcome.result.total_reward == 1.0, outcome
            count += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    await env.close()
    return count / elapsed


async def main(seconds: float) -> None:
    bwrap = BwrapProvider()
    print(f"cores: {os.cpu_count()}, bwrap mode: {bwrap.probe()}")
    baseline = UnisolatedProvider(allow_unisolated=True)
    print(f"{'case':<44} {'unisolated':>12} {'bwrap':>12} {'ratio':>8}")
    for concurrency in (1, 2, 4):
        base = await execs_per_second(baseline, concurrency, seconds)
        iso = await execs_per_second(bwrap, concurrency, seconds)
        case = f"test executions/s, {concurrency} concurrent"
        print(f"{case:<44} {base:>12.1f} {iso:>12.1f} {iso / base:>8.2f}")
    for concurrency in (1, 4):
        rate = await rewards_per_second(concurrency, seconds)
        print(f"{f'code-env rewards/s (3 tests), {concurrency} concurrent':<44} {'':>12} {rate:>12.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    asyncio.run(main(parser.parse_args().seconds))
