"""The trainer group on a local Ray cluster: settings read once, one packed batch for every rank,
the ranks' timelines merged, checkpoints under the run directory, each rank's output and logging
collected. Tiny model, two CPU ranks (gloo)."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace

import pytest
import ray
from ray.util.placement_group import remove_placement_group

from refractor.algorithms.packing import PackingSettings
from refractor.config import RefractorConfig
from refractor.records import TrainSample
from refractor.runtime.cluster import reserve
from refractor.runtime.trainer_group import RayTrainerGroup, TrainerActor, TrainerGroupSettings
from refractor.trainer.settings import TrainerSettings


def group_config(model, tmp_path, **overrides) -> RefractorConfig:
    values = dict(
        environments=[{"name": "countdown"}],
        model=str(model),
        learning_rate=1e-3,
        seq_len=128,
        pad_to_multiple_of=16,
        entropy_chunk_size=48,
        run_dir=str(tmp_path),
        run_name="group",
        trainer_call_timeout_s=120,
    )
    return RefractorConfig(**{**values, **overrides})


def samples(n: int = 5) -> list[TrainSample]:
    out = []
    for i in range(n):
        length = 20 + 7 * i
        mask = [0] * 4 + [1] * (length - 4)
        lps = [0.0] * 4 + [-5.0] * (length - 4)
        out.append(TrainSample(list(range(3, 3 + length)), mask, (-1.0) ** i, lps, sample_id=i))
    return out


def test_settings_are_read_once_from_the_config(tmp_path):
    cfg = group_config("some/model", tmp_path, number_of_minibatches=2, trainer_call_timeout_s=33)
    s = TrainerGroupSettings.from_config(cfg, pad_token_id=5)
    # the config's trainer keys, with the GPU share activation_checkpointing: auto plans for resolved
    assert s.trainer == replace(TrainerSettings.from_config(cfg), trainer_memory_fraction=0.9)
    assert s.packing == PackingSettings.from_config(cfg, pad_token_id=5)
    assert (s.packing.number_of_minibatches, s.packing.pad_token_id, s.call_timeout_s) == (2, 5, 33.0)
    # across nodes rank 0 listens on its node's address (None: resolved there); on one node, loopback
    assert (s.rendezvous_host, s.weight_transfer_host, s.weight_sync.control_token) == (None, None, None)
    one = TrainerGroupSettings.from_config(cfg, pad_token_id=5, control_token="secret", single_node=True)
    assert (one.rendezvous_host, one.weight_transfer_host) == ("127.0.0.1", "127.0.0.1")
    # ray_broadcast_prefer_loopback_if_single_node: false puts the weight transfer on the node's address
    routed = group_config("some/model", tmp_path, ray_broadcast_prefer_loopback_if_single_node=False)
    no_loopback = TrainerGroupSettings.from_config(routed, pad_token_id=5, single_node=True)
    assert (no_loopback.rendezvous_host, no_loopback.weight_transfer_host) == ("127.0.0.1", None)
    assert one.weight_sync.control_token == "secret" and "secret" not in repr(one)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_two_ranks_train_on_one_packed_batch_and_merge_their_timelines(local_ray, tiny_qwen2_path, tmp_path):
    reservation = reserve("trainer ranks", 2, 1, 0, "PACK", 60, "cpus", "workers")
    settings = TrainerGroupSettings.from_config(
        group_config(tiny_qwen2_path, tmp_path), pad_token_id=0, single_node=True
    )
    group = RayTrainerGroup(settings, reservation)
    try:
        infos = group.setup()
        assert [i["rank"] for i in infos] == [0, 1] and {i["device"] for i in infos} == {"cpu"}

        result = asyncio.run(group.train_step(0, samples()))
        # every packed row ran once, on the rank it was packed for (no-op rows are counted apart)
        assert result.metrics["trainer/batch/micro_batches"] == result.metrics["packing/micro_batches"]
        assert (
            result.metrics["trainer/batch/noop_micro_batches"] == result.metrics["packing/noop_micro_batches"]
        )
        assert result.metrics["learning_rate"] == 1e-3 and result.step == 0
        steps = [e for e in result.timeline if e.name == "step"]
        assert sorted(e.attrs["rank"] for e in steps) == [0, 1]
        node = ray.util.get_node_ip_address()
        assert all(e.attrs["node"] == node and e.attrs["gpu"] is None for e in result.timeline)

        spans = asyncio.run(group.save_checkpoint(1, {"next_sample_idx": 5}))
        for rank in (0, 1):  # every rank's save, its phases inside it
            mine = {e.name: e for e in spans if e.attrs["rank"] == rank}
            assert {"checkpoint", "checkpoint/get_state_dict", "checkpoint/dcp_save"} <= set(mine)
            assert ("checkpoint/retention" in mine) == (rank == 0)  # rank 0 applies the retention
            whole = mine.pop("checkpoint")
            assert all(whole.start <= e.start <= e.end <= whole.end for e in mine.values())
            assert all(e.attrs["step"] == 1 and e.attrs["node"] == node for e in spans)
        assert json.loads(group.read_checkpoint_file(1, "orchestrator.json")) == {"next_sample_idx": 5}
        assert (tmp_path / "group" / "checkpoints" / "step_1" / "meta.json").is_file()
        assert group.read_checkpoint_file(1, "missing.json") is None
    finally:
        group.shutdown()
        remove_placement_group(reservation.group)


# Well past the capture's burst (5,000 lines) even at its rate (500 lines/s) over the seconds a busy
# machine takes to print it; small enough that printing and reading it back stay cheap.
FLOOD = 30_000


def test_a_rank_s_prints_and_logging_reach_the_store_while_it_is_busy_and_a_flood_is_counted(
    local_ray, tmp_path
):
    from refractor.runtime.log_collector import LogCollector
    from refractor.telemetry.log_capture import ProcessLogs
    from refractor.telemetry.log_files import LogFileCopies
    from refractor.telemetry.query import RunReader
    from refractor.telemetry.store import RunStore

    def _print_log_flood_then_wait(actor, release: str, flood: int) -> None:
        # runs inside the rank (``__ray_call__``; defined here: pickled by value): what user code may do
        import logging
        import os
        import time

        print("hello from a rank")
        logging.getLogger("refractor.trainer.user").info("a logging call")
        for i in range(flood):
            print(f"flood {i}")
        while not os.path.exists(release):  # the rank stays busy until the test has read its lines
            time.sleep(0.05)

    reservation = reserve("trainer ranks", 1, 1, 0, "PACK", 60, "cpus", "workers")
    group = RayTrainerGroup(TrainerGroupSettings.from_config(group_config("m", tmp_path), 0), reservation)
    store = RunStore(tmp_path)
    driver = ProcessLogs("driver", None, "here", capture_streams=False)
    collector = LogCollector(driver, store.log_lines, LogFileCopies(tmp_path / "logs"), store.log_event)
    (rank0,) = group.actors
    collector.add_actor_source("trainer", 0, rank0.drain_logs.remote)
    gone = TrainerActor.remote(group.settings, 1, 2)
    ray.kill(gone, no_restart=True)
    collector.add_actor_source("trainer", 1, gone.drain_logs.remote)
    release = tmp_path / "release"
    try:
        busy = rank0.__ray_call__.remote(_print_log_flood_then_wait, str(release), FLOOD)

        async def until_busy() -> None:
            for _ in range(3000):  # the lines arrive while the rank is still in its call (5 min: busy CPUs)
                await collector.collect()
                store.flush()
                with RunReader(tmp_path) as reader:
                    if reader.logs(text="hello from a rank", component="trainer"):
                        return
                await asyncio.sleep(0.1)
            raise AssertionError("the rank's lines never arrived")

        asyncio.run(until_busy())
        assert ray.wait([busy], timeout=0)[0] == []  # still busy: drain_logs ran beside it
        release.touch()
        ray.get(busy, timeout=60)
        collector.close()
        store.close()
        with RunReader(tmp_path) as reader:
            lines = reader.logs(component="trainer", rank=0, limit=100_000)
            failures = [e for e in reader.timeline() if e["name"] == "log_collection_failed"]
        by_message = {r["message"]: r for r in lines}
        assert by_message["hello from a rank"]["source"] == "stdout"
        assert by_message["refractor.trainer.user: a logging call"]["source"] == "log"
        assert by_message["hello from a rank"]["node"] == ray.util.get_node_ip_address()
        # one warning per drain that dropped lines: the flood may span drains (when the machine is busy,
        # the rank is still printing at the drain that first sees its hello)
        dropped = [r for r in lines if "were dropped" in r["message"]]
        kept = sum(r["message"].startswith("flood ") for r in lines)
        assert dropped and all(r["level"] == "WARNING" for r in dropped)
        counts = [
            re.search(r"refractor: (\d+) lines of trainer-0 were dropped", r["message"]) for r in dropped
        ]
        assert all(counts) and sum(int(m.group(1)) for m in counts) == FLOOD - kept
        assert 4_000 < kept < FLOOD  # the burst and what the rate let through, not the flood
        # the dead rank once, though collected many times (on busy CPUs a slow drain of the live rank may
        # time out and be recorded too)
        assert [e["attrs"]["source"] for e in failures].count("trainer-1") == 1
        assert "[stdout] hello from a rank" in (tmp_path / "logs" / "trainer-0.log").read_text()
    finally:
        group.shutdown()
        remove_placement_group(reservation.group)
