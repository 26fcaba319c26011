"""Test doubles for the orchestrator's *dependencies* (servers, trainer, clock, store) and two tiny
real environments, imported by the tests of this folder as ``orch_fakes``. The orchestrator itself is
always the real one."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from refractor.config import RefractorConfig
from refractor.envs.base import MultiTurnEnvironment, SingleTurnEnvironment
from refractor.records import RewardResult, Sample, StepResult


class FakeClock:
    """Deterministic time: every reading advances by one millisecond."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


@dataclass
class FakeResult:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_versions: list[Any] = field(default_factory=list)
    latency: dict[str, float] = field(default_factory=dict)
    server_request_id: str | None = None


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: Any
    priority: int
    future: asyncio.Future
    prompt_text: str = ""


class FakeServer:
    """Same async ``generate`` signature as the real client.

    ``manual=True``: requests wait until the test finishes them (``finish(req, text)``); otherwise
    each request answers after a seeded random number of event-loop yields. The answer text comes
    from ``answer(prompt_text, sampling)`` and is encoded with the real tokenizer (+ eos).
    """

    def __init__(
        self, name: str, tokenizer, manual: bool = False, answer=None, seed: int = 0, max_yields: int = 5
    ) -> None:
        self.name = name
        self.tok = tokenizer
        self.manual = manual
        self.answer = answer or (lambda prompt, sampling: "yes")
        self.rng = random.Random(seed)
        self.max_yields = max_yields
        self.pending: list[Request] = []
        self.calls: list[Request] = []
        self.cancelled = 0

    def result_for(self, text: str, max_tokens: int) -> FakeResult:
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        finish = "stop"
        if len(ids) > max_tokens:
            ids = ids[:max_tokens]
            finish = "length"
        return FakeResult(ids, [-0.5 - 0.01 * i for i in range(len(ids))], finish)

    async def generate(self, token_ids, sampling, *, priority=0):
        req = Request(
            list(token_ids),
            sampling,
            priority,
            asyncio.get_running_loop().create_future(),
            self.tok.decode(token_ids),
        )
        self.calls.append(req)
        try:
            if self.manual:
                self.pending.append(req)
                text = await req.future
            else:
                for _ in range(self.rng.randint(0, self.max_yields)):
                    await asyncio.sleep(0)
                text = self.answer(req.prompt_text, sampling)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            if req in self.pending:
                self.pending.remove(req)
        return self.result_for(text, sampling.max_tokens)

    def find(self, fragment: str) -> list[Request]:
        return [r for r in self.pending if fragment in r.prompt_text]

    def finish(self, req: Request, text: str = "yes") -> None:
        req.future.set_result(text)


class FakeTrainer:
    """Records what the orchestrator asks; ``gate`` (when set) holds every train_step until opened."""

    def __init__(self, on_step=None) -> None:
        self.steps: list[tuple[int, list]] = []
        self.updates: list[int] = []
        self.checkpoints: list[tuple[int, dict]] = []
        self.log: list[str] = []
        self.gate: asyncio.Event | None = None
        self.on_step = on_step

    async def train_step(self, step, samples):
        if self.gate is not None:
            await self.gate.wait()
        self.steps.append((step, samples))
        self.log.append(f"train {step}")
        if self.on_step:
            self.on_step(step)
        return StepResult(step, {"kl_divergence_inference": 0.01 * step, "grad_norm": 1.0})

    async def update_weights(self, version, target="full"):
        await asyncio.sleep(0)
        self.updates.append(version)
        self.log.append(f"update {version}")
        return []

    async def save_checkpoint(self, step, orchestrator_state):
        self.checkpoints.append((step, orchestrator_state))
        self.log.append(f"checkpoint {step}")


class ToyEnv(SingleTurnEnvironment):
    """Questions "question <i>"; reward 1 when the answer contains "yes"."""

    def __init__(
        self,
        n: int = 8,
        name: str = "toy",
        reward_gate: asyncio.Event | None = None,
        fail: str | None = None,
        **kw,
    ) -> None:
        super().__init__(**kw)
        self._name = name
        self.n = n
        self.reward_gate = reward_gate
        self.fail = fail
        self.scored = 0

    def load_dataset(self, num_samples: int = -1, **kwargs):
        self._samples = [Sample(f"question {i}", "yes") for i in range(self.n)]
        return self._samples

    async def compute_reward(self, completion, sample, eos_token=""):
        if self.reward_gate is not None:
            await self.reward_gate.wait()
        if self.fail == "raise":
            raise RuntimeError("judge unavailable")
        if self.fail == "hang":
            await asyncio.sleep(30)
        self.scored += 1
        return RewardResult(float("yes" in completion), {"correct": float("yes" in completion)})


class ToyChatEnv(MultiTurnEnvironment):
    """Multi-turn: the environment answers "again <turn>" until max_turns."""

    def __init__(self, n: int = 8, max_turns: int = 2, name: str = "chat", **kw) -> None:
        super().__init__(max_turns=max_turns, **kw)
        self._name = name
        self.n = n

    def load_dataset(self, num_samples: int = -1, **kwargs):
        self._samples = [Sample(f"question {i}", "yes") for i in range(self.n)]
        return self._samples

    async def env_response(self, messages, state):
        return [{"role": "user", "content": f"again {state.num_turns}"}]

    async def compute_reward(self, state, eos_token=""):
        text = state.completion_text
        return RewardResult(float(text.count("yes")), {"yes_count": float(text.count("yes"))})


def make_config(env_names=("toy",), **overrides) -> RefractorConfig:
    base = dict(
        environments=[{"name": n} for n in env_names],
        group_size=2,
        max_concurrent_prompts_per_server=2,
        prompts_batch_size_for_trainer=1,
        number_of_steps=3,
        max_tokens=16,
        max_model_len=256,
        max_async_rollout=1,
        max_off_policy_steps=-1,
        prompt_prefetch_buffer_size=2,
        use_wandb=False,
        discard_group_zero_advantage=False,
        inference_num_workers=1,
        trainer_num_workers=1,
        eval_num_servers=0,
    )
    base.update(overrides)
    return RefractorConfig(**base)


class MemoryStore:
    """The store's write API kept in lists (the real RunStore is tested in tests/telemetry)."""

    def __init__(self) -> None:
        self.rollouts: list[tuple[Any, int, int]] = []
        self.steps: dict[int, dict[str, float]] = {}
        self.events: list[Any] = []
        self.meta: dict[str, Any] = {}

    def set_meta(self, items, replace_existing=True):
        self.meta.update(items)

    def log_rollouts(self, rollouts, trainer_step, inference_step):
        self.rollouts += [(r, trainer_step, inference_step) for r in rollouts]

    def log_step_metrics(self, step, metrics, timestamp=None):
        self.steps[step] = dict(metrics)

    def log_event(self, event, step=None):
        self.events.append(event)

    def log_events(self, events, step=None):
        self.events += list(events)

    def log_system_metrics(self, source, metrics, timestamp=None):
        self.events.append(("system", source, dict(metrics)))

    def by_status(self, status: str) -> list[Any]:
        return [r for r, _, _ in self.rollouts if str(r.status) == status]


async def wait_until(predicate, what: str, timeout_s: float = 10.0) -> None:
    """Yield to the loop until ``predicate()`` holds (prompt preparation runs in a thread, so
    after many bare yields this also sleeps briefly)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    i = 0
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0 if i < 200 else 0.001)
        i += 1


async def settle(n: int = 300) -> None:
    """Let every runnable task advance (including prompt preparation threads)."""
    for i in range(n):
        await asyncio.sleep(0 if i % 50 else 0.001)
