"""Placement of servers and trainer ranks: when GPUs are shared, what is reserved for each layout on
a cluster with logical GPUs (Ray counts them; no hardware needed), and a run that cannot fit fails
at once naming the keys to change."""

from __future__ import annotations

import time

import pytest
import ray
from ray.util.placement_group import placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from refractor.config import RefractorConfig
from refractor.runtime.cluster import ClusterError
from refractor.runtime.placement import Demand, check_fits, colocated, place

ONE_SERVER_ONE_RANK = Demand(servers=1, tensor_parallel=1, server_cpus=1, ranks=1, trainer_cpus=1)


def config(**overrides) -> RefractorConfig:
    values = dict(
        environments=[{"name": "countdown"}],
        model="/models/policy",
        inference_num_workers=1,
        trainer_num_workers=1,
        ray_inference_cpus_per_worker=1,
        ray_trainer_cpus_per_worker=1,
        ray_placement_timeout_s=60,
    )
    return RefractorConfig(**{**values, **overrides})


@pytest.mark.parametrize(
    ("setting", "gpus", "expected"),
    [
        ("auto", 0, False),  # nothing to share on CPU
        ("auto", 1, True),  # one GPU: a split run needs two
        ("auto", 2, False),  # room for both
        (True, 2, True),
        (False, 1, False),
    ],
)
def test_auto_shares_gpus_only_when_a_split_run_would_not_fit(setting, gpus, expected):
    assert colocated(setting, ONE_SERVER_ONE_RANK, gpus) is expected


def test_engine_memory_share_follows_the_placement_unless_set():
    assert config().engine_memory_share(colocated=False) == 0.9
    assert config().engine_memory_share(colocated=True) == 0.4
    assert config(gpu_memory_utilization=0.6).engine_memory_share(colocated=True) == 0.6


@pytest.mark.parametrize(
    ("setting", "max_async", "colocate", "expected"),
    [
        ("auto", 0, True, True),  # colocated and synchronous: the trainer gets the servers' memory
        ("auto", 2, True, False),  # generation overlaps training: nothing may sleep
        ("auto", 0, False, False),  # a GPU of its own: nobody to give memory to
        (True, 0, False, True),
        (False, 0, True, False),
    ],
)
def test_servers_sleep_in_colocated_synchronous_runs(setting, max_async, colocate, expected):
    cfg = config(inference_sleep_during_training=setting, max_async_rollout=max_async)
    assert cfg.sleeps_during_training(colocate) is expected


def test_sleeping_servers_and_async_generation_are_refused_together():
    with pytest.raises(
        ValueError, match=r"`inference_sleep_during_training: true` needs `max_async_rollout: 0`"
    ):
        config(inference_sleep_during_training=True, max_async_rollout=1)


@pytest.mark.parametrize(
    ("demand", "colocate", "cpus", "gpus", "message"),
    [
        (ONE_SERVER_ONE_RANK, False, 8, 1, r"needs 2 GPUs .* has 1\. Set `colocate: true`"),
        (
            Demand(servers=2, tensor_parallel=1, server_cpus=1, ranks=1, trainer_cpus=1),
            True,
            8,
            1,
            r"colocated, the run needs 2 GPU\(s\) .* has 1\. Lower `inference_num_workers`",
        ),
        (
            Demand(servers=1, tensor_parallel=2, server_cpus=1, ranks=2, trainer_cpus=1),
            True,
            8,
            2,
            r"set `inference_tensor_parallel_size: 1` \(it is 2\) or `colocate: false`",
        ),
        (ONE_SERVER_ONE_RANK, True, 1, 1, r"needs 2 CPUs .* has 1\. Lower `ray_inference_cpus_per_worker`"),
    ],
    ids=["split-on-one-gpu", "two-servers-one-gpu", "tensor-parallel-colocated", "cpus"],
)
def test_what_cannot_fit_names_the_keys(demand, colocate, cpus, gpus, message):
    with pytest.raises(ClusterError, match=message):
        check_fits(demand, colocate, cpus, gpus)


def test_custom_resources_the_cluster_lacks_name_the_key():
    pinned = Demand(
        servers=2,
        tensor_parallel=1,
        server_cpus=1,
        ranks=1,
        trainer_cpus=1,
        server_resources={"inference_node": 1},
    )
    with pytest.raises(
        ClusterError, match=r"`ray_inference_resources` asks 1 'inference_node' for each of 2 .* has 1"
    ):
        check_fits(pinned, False, 8, 0, {"inference_node": 1})
    check_fits(pinned, False, 8, 0, {"inference_node": 2})
    # colocated, bundle i holds server i's and rank i's resources together
    both = Demand(1, 1, 1, 2, 1, server_resources={"a": 1}, trainer_resources={"a": 0.5, "b": 1})
    assert [both.bundle_resources(i) for i in range(2)] == [{"a": 1.5, "b": 1}, {"a": 0.5, "b": 1}]


@pytest.mark.parametrize(
    ("resources", "message"),
    [({"GPU": 1}, "names 'GPU', which Ray accounts itself"), ({"n": 0}, r"'n' must be in \(0, ")],
)
def test_custom_resource_settings_are_checked(resources, message):
    with pytest.raises(ValueError, match=message):
        config(ray_trainer_resources=resources)


def test_what_fits_passes():
    check_fits(ONE_SERVER_ONE_RANK, True, 2, 1)
    check_fits(ONE_SERVER_ONE_RANK, False, 2, 2)
    check_fits(ONE_SERVER_ONE_RANK, False, 2, 0)


@pytest.fixture(scope="module")
def two_gpu_cluster():
    ray.shutdown()
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote
class Probe:
    def gpus(self) -> list[str]:
        return [str(g) for g in ray.get_gpu_ids()]


def _probe(reservation, index: int):
    return Probe.options(
        num_cpus=reservation.cpus,
        num_gpus=reservation.gpus,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            reservation.group, placement_group_bundle_index=index
        ),
    ).remote()


def test_colocated_a_server_and_a_rank_share_each_gpu(two_gpu_cluster):
    placement = place(config(colocate=True, inference_num_workers=2, trainer_num_workers=2), "t")
    try:
        assert placement.colocated and placement.servers.group == placement.trainers.group
        assert [name for name, _ in placement.groups] == ["servers and trainer ranks (colocated)"]
        bundles = placement_group_table(placement.servers.group)["bundles"]
        assert list(bundles.values()) == [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]
        servers = [_probe(placement.servers, i) for i in range(2)]
        ranks = [_probe(placement.trainers, i) for i in range(2)]
        server_gpus = ray.get([a.gpus.remote() for a in servers], timeout=60)
        rank_gpus = ray.get([a.gpus.remote() for a in ranks], timeout=60)
        assert server_gpus == rank_gpus  # server i and rank i on the same GPU
        assert server_gpus[0] != server_gpus[1]  # and each pair on its own
    finally:
        remove_placement_group(placement.servers.group)


def test_split_every_actor_holds_whole_gpus(two_gpu_cluster):
    placement = place(config(colocate="auto"), "t")  # 1 server + 1 rank fit 2 GPUs: no sharing
    try:
        assert not placement.colocated
        assert [name for name, _ in placement.groups] == ["inference servers", "trainer ranks"]
        assert (placement.servers.gpus, placement.trainers.gpus) == (1, 1)
        assert placement.servers.group != placement.trainers.group
    finally:
        for _, reservation in placement.groups:
            remove_placement_group(reservation.group)


def test_a_run_too_big_fails_at_once_without_reserving_anything(two_gpu_cluster):
    start = time.monotonic()
    with pytest.raises(ClusterError, match=r"needs 3 GPUs .* has 2\. Set `colocate: true`"):
        place(config(colocate=False, inference_num_workers=2), "t")
    assert time.monotonic() - start < 10  # not the placement timeout (60 s here)
    assert not [pg for pg in placement_group_table().values() if pg["state"] != "REMOVED"]
