"""Programming tasks whose tests run in a sandbox: local (bubblewrap) or a hosted service.

Reward = ``passed``: 1.0 iff every selected test passes. Diagnostics are per-sample metrics with
Telescope's names (``pass_rate``, ``num_test_cases``, ``num_timeouts``, ``test_time``...) and
info turns (``generated_code``, ``error``, ``test_summary``, ``passed_tests``, ``failed_tests``).
A sandbox infrastructure failure (after ``max_attempts``) raises, so the rollout is discarded
with that reason instead of being trained on a false zero.

Dataset rows: ``question`` and ``info`` (dict or JSON text) whose ``tests`` (dict or JSON text)
has ``inputs``, ``outputs`` and optionally ``fn_name`` (function-call style when non-empty).

``i3_code`` is the same environment under Telescope's name and kwargs: ``provider`` (``local``,
``e2b``, ``modal``, ``daytona``, ``prime``) and ``docker_image``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any, ClassVar

from refractor.envs.base import SingleTurnEnvironment, strip_eos
from refractor.envs.builtin.code_tests import decode_test_value, run_tests, summarize
from refractor.envs.data import load_rows, take
from refractor.envs.parsers import extract_code_block, strip_think_tags
from refractor.envs.sandbox import (
    REMOTE_PROVIDERS,
    SandboxConfig,
    SandboxError,
    SandboxPool,
    check_provider_name,
    get_provider,
)
from refractor.records import RewardResult, Sample, info_turn

DEFAULT_DATASET = "PrimeIntellect/INTELLECT-3-RL"
INSTRUCTION_PROMPT = "Solve the programming task below in a Python markdown code block."
INFO_LIMIT = 4000


def extract_program(completion: str) -> str | None:
    """No code while thinking is unfinished; else the last fenced block after the thoughts."""
    if "<think>" in completion and "</think>" not in completion:
        return None
    return extract_code_block(strip_think_tags(completion), "python")


class CodeEnvironment(SingleTurnEnvironment):
    strict_kwargs = True
    needs_sandbox: ClassVar[bool] = True
    reward_min = 0.0
    reward_max = 1.0
    metrics_ranges: ClassVar[dict[str, dict[str, Any]]] = {
        "passed": {"min": 0.0, "max": 1.0, "invert": False},
        "pass_rate": {"min": 0.0, "max": 1.0, "invert": False},
        "num_timeouts": {"min": 0.0, "max": None, "invert": True},
    }

    def __init__(
        self,
        system_prompt: str | None = None,
        instruction_prompt: str | None = INSTRUCTION_PROMPT,
        dataset_name: str = DEFAULT_DATASET,
        dataset_subset: str | None = "code",
        dataset_split: str = "train",
        difficulty_key: str = "avg@8_qwen3_4b_instruct_2507",
        min_difficulty: float = 0.0,
        max_difficulty: float = 1.0,
        max_num_tests: int = 15,
        random_seed: int = 42,
        timeout_per_test: float = 10.0,
        test_workers: int = 2,
        memory_mb: int = 1024,
        disk_mb: int = 256,
        sandbox_provider: str = "auto",
        sandbox_image: str | None = None,
        allow_unisolated: bool = False,
        pool_size: int = 4,
        max_attempts: int = 2,
        **kwargs: Any,
    ) -> None:
        super().__init__(system_prompt=system_prompt, instruction_prompt=instruction_prompt, **kwargs)
        self.dataset_name = dataset_name
        self.dataset_subset = dataset_subset
        self.dataset_split = dataset_split
        self.difficulty_key = difficulty_key
        self.min_difficulty = min_difficulty
        self.max_difficulty = max_difficulty
        self.max_num_tests = max_num_tests
        self.random_seed = random_seed
        self.timeout_per_test = timeout_per_test
        self.test_workers = test_workers
        self.max_attempts = max_attempts
        self.sandbox_provider = sandbox_provider
        check_provider_name(sandbox_provider)
        if sandbox_provider in REMOTE_PROVIDERS:
            get_provider(sandbox_provider)  # a missing SDK or credentials fail here, not mid-run
        self.allow_unisolated = allow_unisolated
        self.pool_size = pool_size
        self.sandbox_config = SandboxConfig(
            memory_mb=memory_mb,
            disk_mb=disk_mb,
            cpu_time_s=max(1, int(timeout_per_test) + 1),
            image=sandbox_image,
        )
        self._pool: SandboxPool | None = None
        self._pool_loop: asyncio.AbstractEventLoop | None = None

    # ----- data ------------------------------------------------------------------------------
    def load_dataset(self, num_samples: int = -1, **kwargs: Any) -> list[Sample]:
        rng = random.Random(self.random_seed)
        samples = []
        for row in load_rows(self.dataset_name, self.dataset_subset, self.dataset_split):
            difficulty = row.get(self.difficulty_key)
            if difficulty is not None and not self.min_difficulty <= float(difficulty) <= self.max_difficulty:
                continue
            sample = self.sample_from_row(row, rng)
            if sample is not None:
                samples.append(sample)
        self._samples = take(samples, num_samples)
        return self._samples

    def sample_from_row(self, row: dict[str, Any], rng: random.Random) -> Sample | None:
        info = row.get("info") or {}
        info = json.loads(info) if isinstance(info, str) else info
        tests = info.get("tests") or {}
        tests = json.loads(tests) if isinstance(tests, str) else tests
        inputs = list(tests.get("inputs") or [])
        outputs = list(tests.get("outputs") or [])
        if not row.get("question") or not inputs or len(inputs) != len(outputs):
            return None
        chosen = sorted(rng.sample(range(len(inputs)), min(self.max_num_tests, len(inputs))))
        fn_name = tests.get("fn_name") or info.get("fn_name") or ""
        metadata = {
            "tests": [[inputs[i], outputs[i]] for i in chosen],
            "fn_name": fn_name,
            "source": str(info.get("source", "")),
        }
        return Sample(prompt=str(row["question"]), answer="", metadata=metadata)

    # ----- sandboxes -------------------------------------------------------------------------
    def _current_pool(self) -> SandboxPool:
        loop = asyncio.get_running_loop()
        if self._pool is None or self._pool_loop is not loop:  # pools are bound to one event loop
            local = self.sandbox_provider not in REMOTE_PROVIDERS
            provider_kwargs = {"allow_unisolated": True} if self.allow_unisolated and local else {}
            provider = get_provider(self.sandbox_provider, **provider_kwargs)
            self._pool = SandboxPool(provider, self.sandbox_config, size=self.pool_size)
            self._pool_loop = loop
        return self._pool

    async def prepare_resources(self) -> None:
        await self._current_pool().start()

    async def close(self) -> None:
        if self._pool is not None and self._pool_loop is asyncio.get_running_loop():
            await self._pool.close()
        self._pool = None

    # ----- reward ----------------------------------------------------------------------------
    async def compute_reward(self, completion: str, sample: Sample, eos_token: str = "") -> RewardResult:
        start = time.perf_counter()
        code = extract_program(strip_eos(completion, eos_token or self.eos_token))
        metrics: dict[str, float] = {"generated_code_chars": float(len(code or "")), "sandbox_error": 0.0}
        if not code:
            metrics.update(
                passed=0.0, pass_rate=0.0, num_test_cases=0.0, total_reward_time=time.perf_counter() - start
            )
            return RewardResult(
                0.0, metrics, {"passed": None}, [info_turn("error", "no code block found", "stderr")]
            )
        mode = "function" if sample.metadata.get("fn_name") else "stdin"
        tests = [
            (decode_test_value(i, mode), decode_test_value(o, mode)) for i, o in sample.metadata["tests"]
        ]
        pool = self._current_pool()
        for attempt in range(self.max_attempts):
            acquire_start = time.perf_counter()
            sandbox = await pool.acquire()
            metrics["sandbox_acquire_time"] = time.perf_counter() - acquire_start
            try:
                test_start = time.perf_counter()
                outcomes = await run_tests(
                    sandbox,
                    code,
                    tests,
                    mode,
                    sample.metadata.get("fn_name", ""),
                    self.timeout_per_test,
                    self.test_workers,
                )
                metrics["test_time"] = time.perf_counter() - test_start
                metrics["tests_execution_time"] = metrics["test_time"]
                break
            except SandboxError:
                if attempt + 1 == self.max_attempts:
                    raise
                metrics["retry_count"] = float(attempt + 1)
            finally:
                await pool.release(sandbox)
        metrics.update(summarize(outcomes))
        metrics.setdefault("retry_count", 0.0)
        metrics["total_reward_time"] = time.perf_counter() - start
        return RewardResult(metrics["passed"], metrics, {"passed": None}, self._info_turns(code, outcomes))

    @staticmethod
    def _info_turns(code: str, outcomes: list) -> list[dict[str, Any]]:
        passed = [str(i) for i, o in enumerate(outcomes) if o.passed]
        failed = [f"{i}: {o.status}" for i, o in enumerate(outcomes) if not o.passed]
        turns = [
            info_turn("generated_code", code[:INFO_LIMIT], "code"),
            info_turn("test_summary", f"{len(passed)}/{len(outcomes)} tests passed"),
            info_turn("passed_tests", ", ".join(passed)[:INFO_LIMIT]),
            info_turn("failed_tests", "; ".join(failed)[:INFO_LIMIT]),
        ]
        first_error = next((o.detail for o in outcomes if not o.passed and o.detail), "")
        if first_error:
            turns.append(info_turn("error", first_error[:INFO_LIMIT], "stderr"))
        return turns


class I3CodeEnvironment(CodeEnvironment):
    """``code`` under Telescope's name: the same tasks and rewards; ``provider`` picks where tests run
    (``local`` is the bubblewrap sandbox) and ``docker_image`` the image of a hosted sandbox."""

    def __init__(self, provider: str = "local", docker_image: str | None = None, **kwargs: Any) -> None:
        super().__init__(sandbox_provider=provider, sandbox_image=docker_image, **kwargs)
