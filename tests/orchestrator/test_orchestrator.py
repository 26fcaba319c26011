"""The real orchestrator driven with fake servers, a fake trainer and a fake clock."""

import asyncio

import pytest
from orch_fakes import (
    FakeClock,
    FakeServer,
    FakeTrainer,
    MemoryStore,
    ToyChatEnv,
    ToyEnv,
    make_config,
    settle,
    wait_until,
)

from refractor.errors import RunSetupError
from refractor.inference.client import InferenceServerError
from refractor.orchestrator import Orchestrator, OrchestratorSettings


def build(tok, cfg, envs=None, servers=None, trainer=None, manual=False, answer=None):
    envs = envs or [ToyEnv()]
    servers = servers or [FakeServer("s0", tok, manual=manual, answer=answer)]
    trainer = trainer or FakeTrainer()
    store = MemoryStore()
    orch = Orchestrator(
        OrchestratorSettings.from_config(cfg), envs, servers, trainer, store, tok, clock=FakeClock()
    )
    return orch, servers, trainer, store


def alternating(prompt, sampling, state={"n": 0}):  # noqa: B006 - a deliberate shared counter
    state["n"] += 1
    return "yes" if state["n"] % 2 else "no"


def test_runs_all_steps_and_feeds_exact_samples(tok):
    orch, _, trainer, store = build(tok, make_config(number_of_steps=3), answer=alternating)
    asyncio.run(orch.run())
    assert [s for s, _ in trainer.steps] == [0, 1, 2] and trainer.updates == [1, 2, 3]
    for _, samples in trainer.steps:
        assert len(samples) == 2
        for s in samples:
            # prompt tokens are never trained; sampled tokens carry the server's logprobs
            n_prompt = s.loss_mask.index(1)
            assert s.rollout_logprobs[:n_prompt] == [0.0] * n_prompt
            assert s.rollout_logprobs[n_prompt] == -0.5
            assert s.input_ids[-1] == tok.eos_token_id
    assert sorted(store.steps) == [0, 1, 2]
    assert store.steps[0]["reward_sum_mean"] == 0.5 and store.steps[2]["kl_divergence_inference"] == 0.02
    assert orch.lanes.in_use() == 0 and not orch.in_flight


def test_async_gate_bounds_generation_ahead_of_weights(tok):
    """max_async_rollout = 1: with the trainer stalled, only the batches of steps 0 and 1 are filled."""
    cfg = make_config(number_of_steps=6, max_async_rollout=1, max_concurrent_prompts_per_server=4)
    orch, _, trainer, store = build(tok, cfg, answer=alternating)
    created = []
    original = orch.dispatch._create_group

    def spy(server, prompt):
        created.append((orch.counters.inference_step, orch.counters.loaded_version))
        original(server, prompt)

    orch.dispatch._create_group = spy

    async def main():
        trainer.gate = asyncio.Event()
        task = asyncio.create_task(orch.run())
        await wait_until(lambda: orch.counters.inference_step == 2, "two batches cut")
        await settle()
        n_created = len(created)
        await settle()
        assert len(created) == n_created  # paused: nothing new while weights are stale
        assert orch.counters.inference_step == 2 and trainer.steps == []
        assert any(e.name == "rollout_paused_max_async" for e in store.events)
        trainer.gate.set()
        await task

    asyncio.run(main())
    assert all(step - version <= 1 for step, version in created)
    assert [s for s, _ in trainer.steps] == list(range(6))
    assert any(e.name == "rollout_resumed_max_async" for e in store.events)


def test_group_completing_past_the_async_limit_is_discarded(tok):
    """Synchronous mode (0): a group still running when the batch is cut is discarded on completion."""
    cfg = make_config(number_of_steps=1, max_async_rollout=0, max_concurrent_prompts_per_server=2)
    orch, [server], trainer, store = build(tok, cfg, manual=True)

    async def main():
        trainer.gate = asyncio.Event()
        task = asyncio.create_task(orch.run())
        await wait_until(lambda: len(server.pending) == 4, "two groups dispatched")
        q0 = server.pending[0].prompt_text
        q1 = server.pending[2].prompt_text
        assert q0 != q1
        for req in server.find(q0.split("user\n")[1].split("<")[0]):
            server.finish(req, "yes")
        await wait_until(lambda: orch.counters.inference_step == 1, "batch 0 cut")
        for req in list(server.pending):
            server.finish(req, "no")
        await wait_until(
            lambda: store.by_status("discarded") or orch.assembler.discarded, "late group judged"
        )
        trainer.gate.set()
        await task

    asyncio.run(main())
    late = store.by_status("discarded")
    # group 1 (and any group started before the cut) completed after it: stale by the async limit
    assert {r.group_id for r in late} >= {1} and {r.reason for r in late} == {"max_async"}


def test_multiturn_off_policy_counts_every_turn(tok):
    """A rollout whose FIRST turn finished before the update is still stale during its second turn."""
    cfg = make_config(env_names=("chat",), number_of_steps=1, max_async_rollout=4, max_off_policy_steps=0)
    orch, [server], trainer, store = build(tok, cfg, envs=[ToyChatEnv(max_turns=2)], manual=True)

    async def main():
        task = asyncio.create_task(orch.run())
        await wait_until(lambda: len(server.pending) == 4, "two groups dispatched")
        q_a = server.pending[0].prompt_text.split("user\n")[1].split("<")[0]
        q_b = server.pending[2].prompt_text.split("user\n")[1].split("<")[0]
        for req in server.find(q_b):  # group B: first turn done, second turn in flight
            server.finish(req, "yes")
        await wait_until(lambda: sum(q_b in r.prompt_text for r in server.calls) == 4, "group B second turn")
        b_second = server.find(q_b)
        assert len(b_second) == 2
        assert all(r.priority == -1 for r in b_second)  # later turns are served first
        for turn in range(2):  # group A: both turns
            await wait_until(
                lambda turn=turn: (
                    sum(q_a in r.prompt_text for r in server.calls) == 2 * (turn + 1)
                    and len(server.find(q_a)) == 2
                ),
                f"group A turn {turn}",
            )
            for req in server.find(q_a):
                server.finish(req, "yes no")
            await settle()
        await task

    asyncio.run(main())
    b = [r for r in store.by_status("cancelled") if r.group_id == 1]  # group B
    assert len(b) == 2 and all(
        r.reason == "off_policy" and r.off_policy_steps == 1 and r.num_turns == 1 for r in b
    )
    assert server.cancelled >= 2  # their second-turn requests were aborted (and any later group's)
    assert orch.lanes.in_use() == 0
    [(step, samples)] = trainer.steps
    # kept group A: two turns each, interleaved exactly (env tokens masked, turn-1 prompt extends turn 0)
    for s in samples:
        text = tok.decode(s.input_ids)
        assert text.count("<|im_start|>assistant") == 2 and "again 1" in text
        trained = tok.decode([t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m])
        assert "again" not in trained and trained.count("yes no") == 2


class PreparingEnv(ToyEnv):
    """``prepare_resources`` waits for ``ready`` (a slow sandbox pool), or fails."""

    def __init__(self, ready: asyncio.Event, fail: bool = False) -> None:
        super().__init__()
        self.ready = ready
        self.fail_prepare = fail
        self.prepared = False

    async def prepare_resources(self) -> None:
        await self.ready.wait()
        if self.fail_prepare:
            raise OSError("no sandbox image")
        self.prepared = True


@pytest.mark.parametrize("eager", [True, False])
def test_eager_prepare_resources_holds_rollouts_until_every_env_is_prepared(tok, eager):
    cfg = make_config(number_of_steps=1, eager_prepare_resources=eager)

    async def main():
        env = PreparingEnv(asyncio.Event())
        orch, [server], _, _ = build(tok, cfg, envs=[env])
        task = asyncio.create_task(orch.run())
        if eager:
            await settle()
            assert server.calls == []  # nothing generated while an environment prepares
        else:
            await wait_until(lambda: server.calls, "rollouts started beside the preparation")
        assert not env.prepared
        env.ready.set()
        await task
        assert env.prepared and server.calls

    asyncio.run(main())


@pytest.mark.parametrize("eager", [True, False])
def test_a_failing_prepare_resources_ends_the_run_naming_the_environment(tok, eager):
    cfg = make_config(number_of_steps=3, eager_prepare_resources=eager)

    async def main():
        ready = asyncio.Event()
        ready.set()
        orch, _, _, _ = build(tok, cfg, envs=[PreparingEnv(ready, fail=True)], manual=True)
        with pytest.raises(RunSetupError, match=r"environment `toy`: prepare_resources\(\) failed: OSError"):
            await orch.run()

    asyncio.run(main())


@pytest.mark.parametrize("policy,second_turn_priority", [("priority", -1), ("fcfs", 0)])
def test_scheduling_policy_decides_whether_later_turns_go_first(tok, policy, second_turn_priority):
    """fcfs sends every request with priority 0: both engines then serve in arrival order."""
    cfg = make_config(env_names=("chat",), number_of_steps=1, vllm_scheduling_policy=policy)
    orch, [server], _, _ = build(tok, cfg, envs=[ToyChatEnv(max_turns=2)])
    asyncio.run(orch.run())
    first = [r.priority for r in server.calls if "again" not in r.prompt_text]
    later = [r.priority for r in server.calls if "again" in r.prompt_text]
    assert first and later
    assert set(first) == {0} and set(later) == {second_turn_priority}


@pytest.mark.parametrize("individual,free_after", [(True, True), (True, False), (False, False)])
def test_no_lane_leaks_under_cancellation_storm(tok, individual, free_after):
    cfg = make_config(
        env_names=("toy", "chat"),
        number_of_steps=12,
        max_async_rollout=2,
        max_off_policy_steps=0,
        group_size=3,
        max_concurrent_prompts_per_server=2,
        enable_individual_sample_lanes=individual,
        free_lane_after_generation=free_after,
        prompt_prefetch_buffer_size=3,
    )
    servers = [FakeServer(f"s{i}", tok, answer=alternating, seed=i, max_yields=40) for i in range(2)]
    orch, _, trainer, store = build(
        tok, cfg, envs=[ToyEnv(n=5), ToyChatEnv(n=5, max_turns=3)], servers=servers
    )
    capacity = 2 * 2 * 3
    peak = []

    def check(step):
        held = [(s, lane) for s in orch.lanes.servers for lane in orch.lanes.held_on(s)]
        peak.append(len(held))
        assert len(held) <= capacity
        for s, lane in held:  # every held lane belongs to a live group on that server
            gid, _ = orch.lanes.holder(s, lane)
            assert gid in orch.in_flight and orch.in_flight[gid].server == s

    trainer.on_step = check
    asyncio.run(orch.run())
    assert len(trainer.steps) == 12
    assert orch.lanes.in_use() == 0 and not orch.in_flight and not orch.generating
    assert max(peak) > 0
    reasons = {(str(r.status), r.reason) for r, _, _ in store.rollouts}
    assert ("kept", "") in reasons and ("cancelled", "off_policy") in reasons  # the storm did cancel


def test_free_lane_after_generation_releases_before_reward(tok):
    gate = asyncio.Event()

    async def scenario(free_after):
        cfg = make_config(
            number_of_steps=1, free_lane_after_generation=free_after, max_concurrent_prompts_per_server=1
        )
        env = ToyEnv(reward_gate=gate)
        orch, [server], trainer, store = build(tok, cfg, envs=[env], answer=alternating)
        gate.clear()
        task = asyncio.create_task(orch.run())
        await wait_until(lambda: len(server.calls) >= 2, "first group generated")
        await settle()
        in_use = orch.lanes.in_use()
        calls = len(server.calls)
        gate.set()
        await task
        return in_use, calls

    async def main():
        return await scenario(True), await scenario(False)

    (_, free_calls), (held_in_use, held_calls) = asyncio.run(main())
    # with the option, lanes are free while rewards wait, so more generation starts meanwhile
    assert held_in_use == 2 and held_calls == 2
    assert free_calls > 2


def test_prompt_too_long_and_reward_failures_discard_with_reason(tok):
    long_env = ToyEnv(name="toy")
    long_env.instruction_prompt = "word " * 300
    cfg = make_config(number_of_steps=1, max_model_len=200, max_tokens=8)
    orch, _, trainer, store = build(tok, cfg, envs=[long_env])

    async def main():
        task = asyncio.create_task(orch.run())
        await wait_until(lambda: len(orch.assembler.discarded) >= 4, "two groups discarded")
        orch.dispatch.stopping = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    discarded = store.by_status("discarded")
    assert discarded and {r.reason for r in discarded} == {"prompt_too_long"}
    assert all(r.turns == [] and "max_model_len 200" in r.error for r in discarded)

    for fail, reason in (("raise", "reward_error"), ("hang", "reward_timeout")):
        cfg = make_config(number_of_steps=1, reward_timeout_s=0.05)
        orch, _, _, store = build(tok, cfg, envs=[ToyEnv(fail=fail)])

        async def run_some(orch=orch):
            task = asyncio.create_task(orch.run())
            await wait_until(lambda orch=orch: len(orch.assembler.discarded) >= 2, "a discarded group")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        asyncio.run(run_some())
        discarded = [r for r, _, _ in store.rollouts if str(r.status) == "discarded"]
        assert discarded and {r.reason for r in discarded} == {reason}
        assert all(reason in r.error for r in discarded)


def test_max_tokens_clamped_to_context(tok):
    cfg = make_config(number_of_steps=1, max_model_len=40, max_tokens=32)
    orch, [server], _, _ = build(tok, cfg, answer=alternating)
    asyncio.run(orch.run())
    for req in server.calls:
        assert req.sampling.max_tokens == min(32, 40 - len(req.prompt_ids))


def test_checkpoint_waits_for_quiet_trainer_and_state_resumes(tok):
    cfg = make_config(
        number_of_steps=4, checkpoint_every=2, max_async_rollout=3, max_concurrent_prompts_per_server=3
    )
    orch, _, trainer, _ = build(tok, cfg, answer=alternating)
    asyncio.run(orch.run())
    assert trainer.log.index("checkpoint 2") < trainer.log.index("train 2")
    assert [s for s, _ in trainer.checkpoints] == [2, 4]  # named by the steps completed
    state = trainer.checkpoints[0][1]
    assert state["counters"]["trainer_step"] == 2 and state["counters"]["loaded_version"] == 2

    orch2, _, trainer2, _ = build(tok, cfg.model_copy(update={"number_of_steps": 4}), answer=alternating)
    orch2.load_state_dict(state)
    assert orch2.counters.inference_step == 2 and orch2.stream.replay  # unconsumed prompts come back first
    asyncio.run(orch2.run())
    assert [s for s, _ in trainer2.steps] == [2, 3]


def test_run_store_holds_every_rollout_and_the_dashboard_recomputes_the_same_metrics(tok, tmp_path):
    import io

    from refractor.telemetry import ConsoleSink, RunReader, RunStore
    from refractor.telemetry.metrics import rollout_step_metrics

    cfg = make_config(
        env_names=("toy", "chat"),
        number_of_steps=4,
        discard_group_zero_advantage=True,
        max_off_policy_steps=0,
        max_async_rollout=2,
    )
    store = RunStore(tmp_path / "run", config=cfg.model_dump(mode="json"))
    out = io.StringIO()
    trainer = FakeTrainer()
    orch = Orchestrator(
        OrchestratorSettings.from_config(cfg),
        [ToyEnv(), ToyChatEnv()],
        [FakeServer("s0", tok, answer=alternating, max_yields=20)],
        trainer,
        store,
        tok,
        sinks=[ConsoleSink(4, quiet=True, stream=out)],
        clock=FakeClock(),
    )
    asyncio.run(orch.run())
    store.close()
    # one console line per step (the zero-advantage warning may come between them: which groups
    # finish first depends on the reward workers' timing)
    assert len([line for line in out.getvalue().splitlines() if line.startswith("step ")]) == 4
    with RunReader(tmp_path / "run") as reader:
        assert reader.config()["number_of_steps"] == 4
        rows = reader.step_metrics()
        assert [r["step"] for r in rows] == [0, 1, 2, 3]
        for row in rows:
            recomputed = rollout_step_metrics(reader.rollout_summaries(row["step"]))
            for name, value in recomputed.items():
                assert row[name] == pytest.approx(value), name
        kept = reader.rollouts(status="kept")
        assert len(kept) == 4 * 2 and all(r["advantage"] != 0 for r in kept)
        multi = [r for r in kept if r["env"] == "chat"]
        if multi:
            turns = reader.turns(multi[0]["rollout_id"])
            assert len(turns) == 2 and turns[0]["env_messages"][0]["content"] == "again 1"
        names = {e["name"] for e in reader.timeline()}
        assert {"training_loop_start", "save_batch", "weight_update"} <= names
        statuses = {r["status"] for r in reader.rollouts()}
        assert "kept" in statuses and statuses <= {"kept", "discarded", "cancelled"}


@pytest.mark.parametrize("cap", [False, True])
def test_dispatch_only_needed_groups_removes_stale_over_dispatch(tok, cap):
    """Sync mode, lanes for 8 groups, batches of 2: filling every free lane starts 8 groups, and the 6
    that finish after the cut are thrown away as `max_async`. The cap starts only the 2 the batch needs,
    and replaces a group that gets discarded."""
    cfg = make_config(
        number_of_steps=1,
        max_async_rollout=0,
        max_concurrent_prompts_per_server=8,
        prompts_batch_size_for_trainer=2,
        discard_group_zero_advantage=True,
        prompt_prefetch_buffer_size=8,
        dispatch_only_needed_groups=cap,
    )
    orch, [server], trainer, store = build(tok, cfg, envs=[ToyEnv(n=16)], manual=True)

    def groups_pending() -> set[str]:
        return {r.prompt_text for r in server.pending}

    async def main():
        task = asyncio.create_task(orch.run())
        expected = 2 if cap else 8
        await wait_until(lambda: len(groups_pending()) == expected, f"{expected} groups dispatched")
        await settle()
        assert len(groups_pending()) == expected  # and no more
        first = sorted(groups_pending())[0]
        for req in [r for r in server.pending if r.prompt_text == first]:
            server.finish(req, "yes")  # every sample scores 1: zero advantage, discarded
        await wait_until(
            lambda: first not in groups_pending() and len(groups_pending()) == expected,
            "the discarded group replaced" if cap else "lanes refilled",
        )
        while server.pending:
            for i, req in enumerate(list(server.pending)):
                server.finish(req, "yes" if i % 2 else "no")
            await settle(20)
        await task

    asyncio.run(main())
    assert [s for s, _ in trainer.steps] == [0]
    stale = [r for r in store.by_status("discarded") if r.reason == "max_async"]
    assert bool(stale) == (not cap)
    assert orch.lanes.in_use() == 0 and not orch.in_flight


class SleepyServer(FakeServer):
    """Logs its sleeps and wakes into the trainer's log; generating while any part sleeps is a bug."""

    def __init__(self, name, tok, log):
        super().__init__(name, tok, answer=alternating)
        self.log = log
        self.asleep: set[str] = set()

    async def sleep(self, level=1, mode="keep"):
        self.log.append(f"sleep {level} {mode}")
        self.asleep = {"weights", "kv_cache"}

    async def wake_up(self, tags=None):
        self.log.append("wake " + ",".join(tags))
        self.asleep -= set(tags)

    async def generate(self, token_ids, sampling, *, priority=0):
        assert not self.asleep, f"generation while {self.asleep} sleep"
        return await super().generate(token_ids, sampling, priority=priority)


@pytest.mark.parametrize("colocated", [True, False])
def test_colocated_synchronous_servers_sleep_while_the_trainer_steps(tok, colocated):
    """Each step: sleep -> train -> wake the weights -> weight update -> wake the KV cache, and no
    generation in between; not colocated (auto), nobody sleeps."""
    cfg = make_config(number_of_steps=3, max_async_rollout=0, inference_sleep_level=2)
    trainer = FakeTrainer()
    server = SleepyServer("s0", tok, trainer.log)
    orch = Orchestrator(
        OrchestratorSettings.from_config(cfg, colocated=colocated),
        [ToyEnv()],
        [server],
        trainer,
        store := MemoryStore(),
        tok,
        clock=FakeClock(),
    )
    asyncio.run(orch.run())
    per_step = ["sleep 2 wait", "train {s}", "wake weights", "update {v}", "wake kv_cache"]
    expected = [e.format(s=s, v=s + 1) for s in range(3) for e in per_step]
    if not colocated:
        expected = [e for e in expected if not e.startswith(("sleep", "wake"))]
    assert trainer.log == expected
    spans = [
        (e.name, e.attrs["step"]) for e in store.events if e.name in ("inference_sleep", "inference_wake")
    ]
    per_step = ["inference_sleep", "inference_wake", "inference_wake"]
    assert spans == ([(name, s) for s in range(3) for name in per_step] if colocated else [])


class WarningSink:
    def __init__(self):
        self.warnings: list[str] = []

    def log_step(self, step, metrics, rollouts):
        pass

    def log_eval(self, step, metrics):
        pass

    def warn(self, message):
        self.warnings.append(message)

    def close(self):
        pass


class FlakyServer(FakeServer):
    """Its third request fails the way a dropped connection does."""

    async def generate(self, token_ids, sampling, *, priority=0):
        if len(self.calls) == 2:
            self.calls.append(None)
            raise InferenceServerError("inference server s0/inference/v1/generate: ReadError: closed (twice)")
        return await super().generate(token_ids, sampling, priority=priority)


def test_a_generation_failure_is_on_the_console_and_in_the_store(tok):
    sink = WarningSink()
    store = MemoryStore()
    orch = Orchestrator(
        OrchestratorSettings.from_config(make_config(number_of_steps=2)),
        [ToyEnv()],
        [FlakyServer("s0", tok, answer=alternating)],
        FakeTrainer(),
        store,
        tok,
        sinks=[sink],
        clock=FakeClock(),
    )
    asyncio.run(orch.run())
    failed = [r for r in store.by_status("discarded") if r.reason == "generation_error"]
    assert len(failed) == 1 and "ReadError: closed (twice)" in failed[0].error
    (warning,) = sink.warnings
    assert "1 of the 2 rollouts of group" in warning and "ReadError: closed (twice)" in warning
    assert [e.attrs["failed"] for e in store.events if e.name == "generation_error"] == [1]
