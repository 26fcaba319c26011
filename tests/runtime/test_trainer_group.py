"""The trainer group on a local Ray cluster: settings read once, one packed batch for every rank,
the ranks' timelines merged, checkpoints under the run directory. Tiny model, two CPU ranks (gloo)."""

from __future__ import annotations

import asyncio
import json

import pytest
import ray
from ray.util.placement_group import remove_placement_group

from refractor.algorithms.packing import PackingSettings
from refractor.config import RefractorConfig
from refractor.records import TrainSample
from refractor.runtime.cluster import reserve
from refractor.runtime.trainer_group import RayTrainerGroup, TrainerGroupSettings
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
    assert s.trainer == TrainerSettings.from_config(cfg)
    assert s.packing == PackingSettings.from_config(cfg, pad_token_id=5)
    assert (s.packing.number_of_minibatches, s.packing.pad_token_id, s.call_timeout_s) == (2, 5, 33.0)
    # across nodes rank 0 listens on its node's address (None: resolved there); on one node, loopback
    assert (s.rendezvous_host, s.weight_transfer_host, s.weight_sync.control_token) == (None, None, None)
    one = TrainerGroupSettings.from_config(cfg, pad_token_id=5, control_token="secret", single_node=True)
    assert (one.rendezvous_host, one.weight_transfer_host) == ("127.0.0.1", "127.0.0.1")
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
