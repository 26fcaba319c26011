"""Pure control logic: lanes, the async gate, off-policy selection, checkpoint gating, batching."""

import pytest

from refractor.orchestrator.async_gate import (
    CheckpointGate,
    CheckpointSchedule,
    GeneratingRollout,
    StepCounters,
    off_policy_groups,
    within_async_limit,
)
from refractor.orchestrator.batching import BatchAssembler
from refractor.orchestrator.lanes import LaneError, LaneManager
from refractor.records import Group, Rollout, RolloutStatus


def test_lanes_smallest_free_id_round_robin_and_misuse():
    lanes = LaneManager(["a", "b"], lanes_per_server=3)
    assert [lanes.acquire("a", k) for k in "xyz"] == [0, 1, 2]
    assert lanes.acquire("a", "w") is None
    lanes.release("a", 1, "y")
    assert lanes.acquire("a", "v") == 1  # smallest free id is reused
    with pytest.raises(LaneError, match="held by"):
        lanes.release("a", 0, "not-x")
    lanes.release("a", 0, "x")
    with pytest.raises(LaneError, match="is free"):
        lanes.release("a", 0, "x")
    assert lanes.pick_server(need=3) == "b"
    assert lanes.acquire_many("a", ["p", "q"]) is None and lanes.free_count("a") == 1  # all-or-nothing
    assert lanes.pick_server() == "a" and lanes.pick_server() == "b"  # round robin
    with pytest.raises(LaneError, match="still has"):
        lanes.remove_server("a")
    with pytest.raises(LaneError, match="unknown server"):
        lanes.acquire("c", "x")


def test_async_gate_worked_example_max_async_2():
    # docs/orchestrator.md#async-gate: with the base model loaded, batches for steps 0, 1, 2 may be generated
    c = StepCounters()
    allowed = []
    for step in range(5):
        c.inference_step = step
        allowed.append(within_async_limit(c, 2))
    assert allowed == [True, True, True, False, False]
    c.loaded_version = 1  # weights of step 0 landed -> step 3 may be filled
    c.inference_step = 3
    assert within_async_limit(c, 2)
    c.inference_step = 4
    assert not within_async_limit(c, 2)
    # max_async_rollout = 0 is synchronous: step N+1 only after step N's weights
    assert within_async_limit(StepCounters(inference_step=1, loaded_version=1), 0)
    assert not within_async_limit(StepCounters(inference_step=2, loaded_version=1), 0)


def test_off_policy_groups_counts_from_first_turn_and_respects_disable():
    gen = [GeneratingRollout(1, 0), GeneratingRollout(1, 3), GeneratingRollout(2, 2), GeneratingRollout(3, 1)]
    assert off_policy_groups(gen, loaded_version=3, max_off_policy_steps=1) == [1, 3]
    assert off_policy_groups(gen, loaded_version=3, max_off_policy_steps=2) == [1]
    assert off_policy_groups(gen, loaded_version=3, max_off_policy_steps=0) == [1, 2, 3]
    assert off_policy_groups(gen, loaded_version=99, max_off_policy_steps=-1) == []


def test_checkpoint_schedule_and_gate():
    sched = CheckpointSchedule(checkpoint_every=2, number_of_steps=5)
    assert [s for s in range(5) if sched.should_save(s)] == [1, 3, 4]
    assert not CheckpointSchedule(False, 5).should_save(4)
    gate = CheckpointGate(sched)
    assert gate.on_batch(0, "b0") == [(0, "b0")] and not gate.paused
    assert gate.on_batch(1, "b1") == [(1, "b1")] and gate.paused  # checkpoint step: submitted, then pause
    assert gate.on_batch(2, "b2") == [] and gate.on_batch(3, "b3") == []  # buffered
    assert not gate.must_save_after(0) and gate.must_save_after(1)
    assert gate.on_saved() == [(2, "b2"), (3, "b3")] and gate.pending_step == 3  # step 3 re-arms the pause
    assert gate.on_batch(4, "b4") == []
    assert gate.on_saved() == [(4, "b4")] and gate.pending_step == 4


def _group(gid, rewards, advantages, failed=None):
    rs = [
        Rollout(gid * 10 + i, gid, i, "env", reward=r, advantage=a)
        for i, (r, a) in enumerate(zip(rewards, advantages, strict=True))
    ]
    if failed is not None:
        rs[failed].mark(RolloutStatus.DISCARDED, "reward_timeout")
    return Group(gid, "env", ("env", gid), rs)


def test_batch_assembly_and_discard_counts():
    c = StepCounters()
    asm = BatchAssembler(
        2,
        max_async_rollout=1,
        discard_group_zero_advantage=True,
        is_zero_advantage=lambda a: max(a) - min(a) <= 1e-9,
    )
    assert asm.add(_group(0, [1, 0], [0.7, -0.7]), c) == []
    assert asm.add(_group(1, [1, 1], [0.0, 0.0]), c) == []  # zero advantage
    g2 = _group(2, [1, 0], [0.7, -0.7], failed=1)
    assert asm.add(g2, c) == []
    assert [r.reason for r in g2.rollouts] == ["group_member_failed", "reward_timeout"]
    asm.add_cancelled(_group(5, [0, 0], [0, 0]))
    [batch] = asm.add(_group(3, [0, 1], [-0.7, 0.7]), c)
    assert batch.step == 0 and [g.group_id for g in batch.groups] == [0, 3] and c.inference_step == 1
    assert all(r.status == RolloutStatus.KEPT for r in batch.rollouts) and {g.step for g in batch.groups} == {
        0
    }
    assert batch.discarded == {"zero_advantage": 2, "group_member_failed": 1, "reward_timeout": 1}
    assert batch.cancelled == {"": 2} and len(batch.discarded_rollouts) == 4
    # async limit at completion: 2 batches cut, base model still loaded, max_async 1 -> discard
    c.inference_step = 2
    late = _group(4, [1, 0], [0.7, -0.7])
    assert asm.add(late, c) == [] and late.reason == "max_async" and late.completion_version == 0
    # group size 1 is never a zero-advantage discard
    single = BatchAssembler(1, 5, True, lambda a: True)
    assert len(single.add(_group(6, [1.0], [0.0]), StepCounters())) == 1
