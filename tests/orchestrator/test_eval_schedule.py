"""The real orchestrator with its eval schedule, driven by fake servers and a fake trainer: baseline,
step evals on a drained eval server with training_only updates while they run, rejoining, the final
eval, resume, and separate_eval_samples; and the schedule alone behind a fake EvalHost."""

from __future__ import annotations

import asyncio

import pytest
from orch_fakes import FakeClock, FakeServer, FakeTrainer, MemoryStore, ToyEnv, make_config, wait_until

from refractor.envs.base import SingleTurnEnvironment
from refractor.evals.passk import parse_pass_k
from refractor.orchestrator import Orchestrator, OrchestratorSettings
from refractor.orchestrator.async_gate import StepCounters
from refractor.orchestrator.eval_runner import (
    EVAL_ID_BASE,
    EvalPlan,
    EvalSetupError,
    EvalTask,
    LoadedEval,
    load_evals,
)
from refractor.orchestrator.eval_schedule import EVAL_DRAIN, EvalResults, EvalScheduler, build_eval_schedule
from refractor.records import EvalMetricsResult, RewardResult, Sample
from refractor.weight_sync import UpdateTarget


class QuizEval(SingleTurnEnvironment):
    """Prompts "quiz <i>"; ``correct`` when the answer says "yes"."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self._name = "quiz"
        self.n = n

    def load_dataset(self, num_samples: int = -1, **kwargs):
        self._samples = [Sample(f"quiz {i}", "yes") for i in range(self.n)]
        return self._samples

    async def compute_reward(self, completion, sample, eos_token=""):
        return RewardResult(0.0)

    async def compute_eval_metrics(self, completion, sample, eos_token=""):
        return EvalMetricsResult(metrics={"correct": float("yes" in completion)})


class GatedServer(FakeServer):
    """Eval prompts wait for ``gate`` while it is cleared; training prompts answer at once."""

    def __init__(self, name, tok, gate: asyncio.Event | None = None) -> None:
        super().__init__(name, tok, answer=lambda prompt, sampling: "yes")
        self.gate = gate

    async def generate(self, token_ids, sampling, *, priority=0):
        if self.gate is not None and "quiz" in self.tok.decode(token_ids):
            await self.gate.wait()
        return await super().generate(token_ids, sampling, priority=priority)


class MergingStore(MemoryStore):
    """Metrics of one step merge, as in the real store (evals share step numbers with training)."""

    def log_step_metrics(self, step, metrics, timestamp=None):
        self.steps.setdefault(step, {}).update(metrics)


class TargetTrainer(FakeTrainer):
    async def update_weights(self, version, target="full"):
        await asyncio.sleep(0)
        self.updates.append((version, target))
        return []


def setup(tok, gate=None, number_of_steps=5, **overrides):
    cfg = make_config(
        number_of_steps=number_of_steps,
        inference_num_workers=2,
        eval_num_servers=1,
        evals=[{"name": "quiz", "eval_every": 2, "pass_k": {"at_k": {"k": [1, 2]}}}],
        **overrides,
    )
    servers = [GatedServer("s0", tok), GatedServer("s1", tok, gate)]
    trainer = TargetTrainer()
    store = MergingStore()
    clock = FakeClock()
    loaded = [LoadedEval(cfg.evals[0], QuizEval(), 3, parse_pass_k(cfg.evals[0].pass_k))]
    scheduler = build_eval_schedule(cfg, loaded, [s.name for s in servers], tok, store, [], clock)
    settings = OrchestratorSettings.from_config(cfg)
    orch = Orchestrator(settings, [ToyEnv()], servers, trainer, store, tok, clock=clock, evals=scheduler)
    return orch, servers, trainer, store, scheduler


def eval_rows(store, step):
    return [r for r in store.by_status("eval") if r.step == step]


def test_baseline_step_and_final_evals(tok):
    gate = asyncio.Event()
    gate.set()
    orch, (s0, s1), trainer, store, scheduler = setup(tok, gate)
    assert scheduler.eval_servers == ["s1"]

    async def main():
        task = asyncio.create_task(orch.run())
        await wait_until(lambda: any(e.name == "eval_baseline_done" for e in store.events), "the baseline")
        gate.clear()  # hold the step eval of step 2: training must go on without s1
        await wait_until(lambda: (3, "training_only") in trainer.updates, "an update while the eval runs")
        assert orch.lanes.free_count("s1") == 0 and set(orch.lanes.held_on("s1")) == set(range(4))
        assert scheduler.eval_version == 2
        gate.set()
        await task

    asyncio.run(main())
    # update 5 lands while the step-4 eval may still run (training_only); the eval servers then get a
    # full update before the final eval, which evaluates version 5 on every server
    assert trainer.updates[:4] == [(1, "full"), (2, "full"), (3, "training_only"), (4, "full")]
    assert trainer.updates[4:] in ([(5, "full")], [(5, "training_only"), (5, "full")])
    for step, version in ((0, 0), (2, 2), (4, 4), (5, 5)):
        m = store.steps[step]
        assert m["eval/quiz/correct"] == 1.0 and m["eval/quiz/pass@2/correct"] == 1.0, step
        assert m["eval/quiz/policy_version"] == version and m["eval/quiz/num_completions"] == 6
        rows = eval_rows(store, step)
        assert len(rows) == 6 and all(r.reward is None and r.sample_metrics["correct"] == 1.0 for r in rows)
        assert {r.end_version for r in rows} == {version}
        assert sorted((r.prompt_index, r.sample_idx) for r in rows) == [
            (i, c) for i in range(3) for c in range(2)
        ]
        servers = {r.server for r in rows}
        assert servers == ({"s1"} if step in (2, 4) else {"s0", "s1"}), step
    assert set(store.steps) == {0, 1, 2, 3, 4, 5}
    names = [e.name for e in store.events if e.name.startswith("eval_")]
    assert names == [
        "eval_baseline_start",
        "eval_baseline_done",
        "eval_step_start",
        "eval_step_done",
        "eval_step_start",
        "eval_step_done",
        "eval_final_start",
        "eval_final_done",
    ]
    # no training rollout ran on s1 with the weights of an eval step (it was drained from 2 on)
    training = [r for r, _, _ in store.rollouts if str(r.status) != "eval"]
    assert all(
        r.first_start_version < 2 for r in training if r.server == "s1" and r.first_start_version is not None
    )
    assert all(
        r.reason == EVAL_DRAIN
        for r in training
        if str(r.status) == "cancelled"
        and r.server == "s1"
        and r.first_start_version is not None
        and r.first_start_version >= 1
    )
    ids = [r.rollout_id for r in store.by_status("eval")]
    assert len(set(ids)) == len(ids) == 24 and min(ids) >= EVAL_ID_BASE
    assert all(r.rollout_id < EVAL_ID_BASE for r in training)
    assert orch.lanes.in_use() == 0
    assert orch.state_dict()["evals"]["ids"]["next_rollout_id"] == EVAL_ID_BASE + 24


def test_a_resumed_run_skips_the_baseline_and_continues_the_eval_ids(tok):
    orch, _, _, store, _ = setup(tok, number_of_steps=2, eval_after_training=False)
    asyncio.run(orch.run())
    state = orch.state_dict()
    assert sorted({r.step for r in store.by_status("eval")}) == [0, 2]

    orch2, _, trainer2, store2, _ = setup(tok, number_of_steps=3)
    orch2.load_state_dict(state)
    asyncio.run(orch2.run())
    assert trainer2.updates == [(3, "full")]
    rows = store2.by_status("eval")
    assert {r.step for r in rows} == {3} and min(r.rollout_id for r in rows) == EVAL_ID_BASE + 12


def test_final_eval_skips_evals_run_at_the_last_step_and_a_failing_eval_fails_the_run(tok):
    orch, _, trainer, store, _ = setup(tok, number_of_steps=2, eval_before_training=False)
    asyncio.run(orch.run())
    assert sorted({r.step for r in store.by_status("eval")}) == [2]  # step 2 is the last step: no final rerun

    orch, _, _, _, scheduler = setup(tok, number_of_steps=3, eval_before_training=False)

    async def broken(*args, **kwargs):
        raise RuntimeError("eval bug")

    scheduler.runner.execute = broken
    with pytest.raises(RuntimeError, match="eval bug"):
        asyncio.run(orch.run())


def test_max_train_minutes_ends_the_run_like_its_last_step(tok):
    """Each train step takes 10 s of the clock; a 0.5-minute budget runs out during the third step:
    the run stops there with a checkpoint and the final eval at step 3, not at number_of_steps."""
    orch, _, trainer, store, _ = setup(tok, number_of_steps=20, max_train_minutes=0.5, checkpoint_every=10)
    trainer.on_step = lambda step: setattr(orch.clock, "t", orch.clock.t + 10.0)
    asyncio.run(orch.run())
    assert [step for step, _ in trainer.steps] == [0, 1, 2]
    assert [step for step, _ in trainer.checkpoints] == [3]  # saved as the last step would be
    assert {r.step for r in store.by_status("eval")} == {0, 2, 3}  # baseline, every 2 steps, final
    assert store.steps[3]["eval/quiz/policy_version"] == 3
    assert [e.attrs["step"] for e in store.events if e.name == "train_time_budget_reached"] == [2]
    assert orch.lanes.in_use() == 0


def test_load_evals_holds_out_eval_prompts_by_content(caplog):
    from refractor.config.schema import EvalEntry
    from refractor.envs import get_environment

    train = get_environment("target_copy", random_targets=True, num_prompts=10)
    other = get_environment("target_copy", random_targets=True, num_prompts=10, seed=1)
    entries = [
        EvalEntry(
            name="target_copy",
            num_samples=3,
            separate_eval_samples=True,
            kwargs={"random_targets": True, "num_prompts": 10},
        )
    ]
    [loaded] = load_evals(entries, {"target_copy": train})
    held = {s.answer for s in loaded.env.samples[:3]}
    assert loaded.num_prompts == 3 and loaded.held_out == 3 and len(train) == 7
    assert not held & {s.answer for s in train.samples}
    [loaded] = load_evals(
        entries, {"target_copy": other}
    )  # other dataset: nothing in common, nothing removed
    assert loaded.held_out == 0 and len(other) == 10 and "removed nothing" in caplog.text
    everything = [
        EvalEntry(
            name="target_copy", separate_eval_samples=True, kwargs={"random_targets": True, "num_prompts": 10}
        )
    ]
    with pytest.raises(EvalSetupError, match="would remove every one of the 7 samples"):
        load_evals(everything, {"target_copy": train})
    with pytest.raises(EvalSetupError, match="eval `nope` could not be loaded"):
        load_evals([EvalEntry(name="nope")], {})


# ----------------------------------------------------------------------------- the schedule alone
class FakeHost:
    """The EvalHost seam: what the schedule orders, recorded."""

    def __init__(self) -> None:
        self.counters = StepCounters()
        self.servers = {"s0": "server s0", "s1": "server s1"}
        self.log: list[tuple] = []

    def drain_servers(self, names, reason):
        self.log.append(("drain", list(names), reason))

    def release_servers(self, names):
        self.log.append(("release", list(names)))

    async def push_weights(self, version, target):
        self.log.append(("push", version, target))


class GatedRunner:
    """Plans without ids; every execution waits for ``gate`` and returns no results."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.runs: list[tuple[int, list]] = []

    def plan(self, tasks, step, ids):
        return EvalPlan(step, list(tasks), [])

    async def execute(self, plan, servers, version):
        self.runs.append((version, servers))
        await self.gate.wait()
        return []


def test_update_targets_drain_before_the_push_training_only_while_the_eval_runs_then_rejoin():
    host = FakeHost()
    runner = GatedRunner()
    task = EvalTask("quiz", None, [], None, None, eval_every=2)  # type: ignore[arg-type]
    results = EvalResults(MemoryStore(), [], FakeClock())
    schedule = EvalScheduler([task], runner, results, ["s0", "s1"], ["s1"], False, False, True)

    async def update(version):
        target = await schedule.update_target(host, version)
        schedule.after_update(host, version, target)
        return target

    async def main():
        await schedule.before_training(host)
        assert await update(1) == UpdateTarget.FULL and host.log == []
        assert (
            await update(2) == UpdateTarget.FULL
        )  # due: the eval server is drained, then the eval starts on it
        assert host.log == [("drain", ["s1"], EVAL_DRAIN)]
        await asyncio.sleep(0)
        assert runner.runs == [(2, ["server s1"])]
        assert (
            await update(3) == UpdateTarget.TRAINING_ONLY
        )  # the eval server keeps the weights being evaluated
        runner.gate.set()
        await schedule.active
        assert await update(4) == UpdateTarget.FULL  # due again: drained again, no rejoin in between
        assert host.log[-1] == ("drain", ["s1"], EVAL_DRAIN) and schedule.eval_version == 4
        await schedule.active
        assert await update(5) == UpdateTarget.FULL
        assert host.log[-1] == ("release", ["s1"])  # the eval servers rejoin with the newest weights
        assert [entry[0] for entry in host.log] == ["drain", "drain", "release"]

    asyncio.run(main())
