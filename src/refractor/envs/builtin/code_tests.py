"""Running a program's test cases in a sandbox and judging the outputs (host side).

Every test is its own ``sandbox.exec`` and the comparison happens here, outside the sandbox, so
the program under test never sees expected outputs and cannot tamper with the judge.
Two styles: ``stdin`` (feed input, compare stdout) and ``function`` (call ``fn_name`` -- a method
of ``Solution`` when that class exists -- with JSON arguments, compare the JSON result).
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Literal

from refractor.envs.sandbox import ExecResult, Sandbox

PRELUDE = (
    "import sys, os, math, re, string, random, heapq, bisect, itertools, functools, collections, json\n"
    "from typing import *\nfrom collections import *\nfrom itertools import *\nfrom functools import *\n"
    "from heapq import *\nfrom bisect import *\nfrom math import *\n"
    "sys.setrecursionlimit(100000)\n"
)

FUNCTION_HARNESS = """import io, json, sys
_args = json.loads(sys.stdin.read())
_real_stdout, sys.stdout = sys.stdout, io.StringIO()
_namespace = {"__name__": "solution"}
exec(compile(open("solution.py").read(), "solution.py", "exec"), _namespace)
_fn_name = sys.argv[1]
_target = getattr(_namespace["Solution"](), _fn_name) if "Solution" in _namespace else _namespace[_fn_name]
_result = _target(*_args) if isinstance(_args, list) else _target(_args)
sys.stdout = _real_stdout
print(json.dumps(_result, default=repr))
"""


@dataclass
class TestOutcome:
    passed: bool
    status: Literal["passed", "failed", "timeout", "error"]
    duration_s: float
    detail: str = ""  # stderr tail or a short mismatch note


def _float_equal(a: str, b: str, tol: float = 1e-3) -> bool:
    try:
        x = float(a)
        y = float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=tol, abs_tol=tol)


def stdout_matches(actual: str, expected: str) -> bool:
    """Exact (trimmed) -> line-wise (trailing spaces ignored) -> token-wise -> numeric tolerance 1e-3."""
    if actual.strip() == expected.strip():
        return True
    lines_a = [line.rstrip() for line in actual.strip().splitlines()]
    lines_e = [line.rstrip() for line in expected.strip().splitlines()]
    if lines_a == lines_e:
        return True
    tokens_a = actual.split()
    tokens_e = expected.split()
    if tokens_a == tokens_e:
        return True
    return len(tokens_a) == len(tokens_e) and all(
        a == e or _float_equal(a, e) for a, e in zip(tokens_a, tokens_e, strict=True)
    )


def _normalize(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _normalize(v) for k, v in value.items()}
    return value


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6)
        except (TypeError, ValueError):
            return False
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def result_matches(actual: Any, expected: Any) -> bool:
    """Function results: tuples as lists; an expected one-element list may wrap the value."""
    actual = _normalize(actual)
    expected = _normalize(expected)
    if _values_equal(actual, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _values_equal(actual, expected[0])


def decode_test_value(value: Any, mode: str) -> Any:
    """Dataset tests store each input/output as JSON text; plain strings are taken as they are."""
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            return value
        return decoded if mode == "function" or isinstance(decoded, str) else value
    return value


def _judge(result: ExecResult, expected: Any, mode: str, duration: float) -> TestOutcome:
    if result.timed_out:
        return TestOutcome(False, "timeout", duration, "time limit exceeded")
    if result.killed_reason:
        return TestOutcome(False, "error", duration, result.killed_reason)
    if result.exit_code != 0:
        return TestOutcome(False, "error", duration, result.stderr[-1000:])
    if mode == "stdin":
        ok = stdout_matches(result.stdout, str(expected))
    else:
        try:
            ok = result_matches(json.loads(result.stdout.strip().splitlines()[-1]), expected)
        except (json.JSONDecodeError, IndexError):
            ok = False
    return TestOutcome(
        ok, "passed" if ok else "failed", duration, "" if ok else f"got: {result.stdout[-300:]!r}"
    )


async def run_tests(
    sandbox: Sandbox,
    code: str,
    tests: list[tuple[Any, Any]],
    mode: Literal["stdin", "function"],
    fn_name: str = "",
    timeout_per_test: float = 10.0,
    workers: int = 2,
) -> list[TestOutcome]:
    """Write the program (with the import prelude) and run every test; infrastructure errors raise."""
    await sandbox.write_file("solution.py", PRELUDE + code)
    if mode == "function":
        await sandbox.write_file("harness.py", FUNCTION_HARNESS)
    limit = asyncio.Semaphore(workers)

    async def one(test_input: Any, expected: Any) -> TestOutcome:
        async with limit:
            start = time.perf_counter()
            if mode == "stdin":
                result = await sandbox.exec(
                    ["python", "solution.py"], stdin=str(test_input), timeout_s=timeout_per_test
                )
            else:
                result = await sandbox.exec(
                    ["python", "harness.py", fn_name],
                    stdin=json.dumps(test_input),
                    timeout_s=timeout_per_test,
                )
            return _judge(result, expected, mode, time.perf_counter() - start)

    return list(await asyncio.gather(*(one(i, o) for i, o in tests)))


def summarize(outcomes: list[TestOutcome]) -> dict[str, float]:
    """The per-sample metrics (Telescope's names) of a test run."""
    times = [o.duration_s for o in outcomes] or [0.0]
    passed = sum(o.passed for o in outcomes)
    return {
        "passed": float(bool(outcomes) and passed == len(outcomes)),
        "pass_rate": passed / len(outcomes) if outcomes else 0.0,
        "num_test_cases": float(len(outcomes)),
        "num_timeouts": float(sum(o.status == "timeout" for o in outcomes)),
        "num_errors": float(sum(o.status == "error" for o in outcomes)),
        "slowest_test_time": max(times),
        "fastest_test_time": min(times),
        "median_test_time": statistics.median(times),
    }
