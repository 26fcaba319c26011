"""The dispatcher alone (no train loop): groups onto free lanes, finished groups handed back,
servers drained for an eval, stale groups cancelled."""

import asyncio
from dataclasses import replace

from orch_fakes import FakeClock, FakeServer, ToyEnv, make_config, settle, wait_until

from refractor.algorithms.advantages import is_zero_advantage_group
from refractor.orchestrator.async_gate import CheckpointGate, CheckpointSchedule, StepCounters
from refractor.orchestrator.batching import BatchAssembler
from refractor.orchestrator.chat import run_chat_tokens
from refractor.orchestrator.dispatch import Dispatcher
from refractor.orchestrator.prompts import PromptPrefetcher, PromptStream
from refractor.orchestrator.rollout import prepare_prompt
from refractor.orchestrator.settings import OrchestratorSettings
from refractor.records import RolloutStatus


def build(tok, servers, **overrides):
    settings = OrchestratorSettings.from_config(make_config(**overrides))
    envs = {"toy": ToyEnv()}
    chat = run_chat_tokens(tok, settings.enable_thinking)
    stream = PromptStream({"toy": len(envs["toy"])}, seed=settings.seed)
    prompts = PromptPrefetcher(
        stream,
        lambda ref: prepare_prompt(envs[ref.env_name], ref.index, chat, ref.ordinal),
        settings.prompt_prefetch_buffer_size,
    )
    assembler = BatchAssembler(
        settings.prompts_batch_size_for_trainer,
        settings.max_async_rollout,
        settings.discard_group_zero_advantage,
        is_zero_advantage_group,
        settings.number_of_steps,
        None,
    )
    events = []
    done = []
    dispatcher = Dispatcher(
        settings,
        envs,
        {s.name: s for s in servers},
        prompts,
        chat,
        replace(settings.rollout, eos_token=tok.eos_token),
        StepCounters(),
        None,
        assembler,
        CheckpointGate(CheckpointSchedule(settings.checkpoint_every, settings.number_of_steps)),
        FakeClock(),
        event=lambda name, **attrs: events.append(name),
        on_group_done=done.append,
    )
    return dispatcher, prompts, events, done


async def start(dispatcher, prompts):
    dispatcher.start()
    prompts.refill()
    dispatcher.wake()
    return asyncio.create_task(dispatcher.loop())


async def stop(dispatcher, prompts, task):
    dispatcher.stopping = True
    await dispatcher.cancel_all("shutdown")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    prompts.close()


def test_fills_free_lanes_and_hands_back_each_finished_group(tok):
    server = FakeServer("s0", tok, manual=True)
    dispatcher, prompts, events, done = build(tok, [server])  # 4 lanes = 2 groups of 2

    async def main():
        task = await start(dispatcher, prompts)
        await wait_until(lambda: len(server.pending) == 4, "both groups started")
        await settle()
        assert len(server.calls) == 4 and dispatcher.lanes.in_use() == 4
        assert sorted(dispatcher.in_flight) == [0, 1]
        for req in list(server.pending):
            server.finish(req)
        await wait_until(lambda: len(done) == 2, "both groups handed back")
        assert sorted(g.group_id for g in done) == [0, 1]
        assert all(r.reward == 1.0 for g in done for r in g.rollouts)
        await wait_until(lambda: len(server.pending) == 4, "two new groups on the freed lanes")
        assert sorted(dispatcher.in_flight) == [2, 3]
        await stop(dispatcher, prompts, task)

    asyncio.run(main())
    assert events.count("inference_call") == 4
    assert dispatcher.lanes.in_use() == 0 and not dispatcher.in_flight and not dispatcher.generating
    shut_down = dispatcher.assembler.cancelled
    assert len(shut_down) == 4 and {r.status for r in shut_down} == {RolloutStatus.CANCELLED}


def test_drained_server_gets_no_work_until_released_and_stale_groups_are_cancelled(tok):
    servers = [FakeServer("s0", tok, manual=True), FakeServer("s1", tok, manual=True)]
    dispatcher, prompts, events, _ = build(
        tok, servers, max_off_policy_steps=0, prompts_batch_size_for_trainer=4
    )

    async def main():
        task = await start(dispatcher, prompts)
        await wait_until(lambda: all(len(s.pending) == 4 for s in servers), "both servers busy")
        dispatcher.drain_servers(["s1"], "eval_drain")
        await settle()
        assert dispatcher.lanes.free_count("s1") == 0
        assert all(dispatcher.lanes.holder("s1", lane) == ("eval", "s1") for lane in range(4))
        assert all(ig.server == "s0" for ig in dispatcher.in_flight.values())
        drained = dispatcher.assembler.cancelled
        assert len(drained) == 4 and {(r.server, r.reason) for r in drained} == {("s1", "eval_drain")}

        dispatcher.release_servers(["s1"])
        await wait_until(lambda: len(servers[1].pending) == 4, "s1 back in training")
        running = sorted(dispatcher.in_flight)
        assert len(running) == 4
        # every rollout started on version 0: one version later all are past max_off_policy_steps 0
        assert dispatcher.cancel_off_policy(version=1) == running
        assert not dispatcher.in_flight
        await stop(dispatcher, prompts, task)

    asyncio.run(main())
    assert events.count("rollout_cancelled_off_policy") == 4
