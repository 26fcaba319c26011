"""Where a run's inference servers and trainer ranks go: split or colocated (docs/config.md#placement).

* **Split**: servers and trainer ranks get placement groups of their own; every server worker and
  every rank holds whole GPUs. A run needs ``inference_num_workers + trainer_num_workers`` GPUs.
* **Colocated** (``colocate: true``, or ``auto`` on a cluster with fewer GPUs than a split run
  needs): one placement group whose bundle ``i`` is one GPU holding server ``i`` and trainer rank
  ``i``; each takes half of the GPU in Ray's accounting, which only lets the two share it. The
  memory is split by the engine's ``gpu_memory_utilization`` (0.4 by default when colocated), and
  the trainer rank uses the rest. Servers are single-GPU (``inference_tensor_parallel_size: 1``).

What a run asks is checked against the whole cluster before anything is reserved, so a run that
cannot fit fails in seconds naming the keys to change, not after ``ray_placement_timeout_s``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group

from refractor.runtime.cluster import ClusterError, Reservation, reserve, reserve_bundles

_GPU_SHARE = 0.5  # Ray's share of a colocated GPU for each of its two actors


@dataclass(frozen=True)
class Demand:
    """What a run asks of the cluster."""

    servers: int
    tensor_parallel: int
    server_cpus: float
    ranks: int
    trainer_cpus: float
    server_resources: Mapping[str, float] = field(default_factory=dict)
    trainer_resources: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, cfg: Any) -> Demand:
        return cls(
            servers=cfg.num_inference_servers,
            tensor_parallel=cfg.inference_tensor_parallel_size,
            server_cpus=cfg.ray_inference_cpus_per_worker,
            ranks=cfg.trainer_num_workers,
            trainer_cpus=cfg.ray_trainer_cpus_per_worker,
            server_resources=dict(cfg.ray_inference_resources),
            trainer_resources=dict(cfg.ray_trainer_resources),
        )

    @property
    def split_gpus(self) -> int:
        return self.servers * self.tensor_parallel + self.ranks

    @property
    def colocated_gpus(self) -> int:
        return max(self.servers, self.ranks)

    def bundle_resources(self, index: int) -> dict[str, float]:
        """The custom resources of colocated bundle ``index`` (server ``index`` and rank ``index``)."""
        out: dict[str, float] = {}
        for holds, asks in (
            (index < self.servers, self.server_resources),
            (index < self.ranks, self.trainer_resources),
        ):
            if holds:
                for name, amount in asks.items():
                    out[name] = out.get(name, 0.0) + amount
        return out


def colocated(setting: bool | str, demand: Demand, cluster_gpus: float) -> bool:
    """``colocate`` resolved: ``auto`` shares GPUs only when a split run would not fit them (on a
    cluster without GPUs nothing is shared)."""
    if setting == "auto":
        return 0 < cluster_gpus < demand.split_gpus
    return bool(setting)


def check_fits(
    demand: Demand,
    colocate: bool,
    cluster_cpus: float,
    cluster_gpus: float,
    cluster_custom: Mapping[str, float] | None = None,
) -> None:
    """Raise ``ClusterError`` naming the keys to change when the run cannot fit the cluster's totals
    (``cluster_custom``: the cluster's custom resources, which ``ray_*_resources`` ask for)."""
    custom = cluster_custom or {}
    for key, count, asks in (
        ("ray_inference_resources", demand.servers, demand.server_resources),
        ("ray_trainer_resources", demand.ranks, demand.trainer_resources),
    ):
        for name, amount in asks.items():
            if count * amount > custom.get(name, 0.0):
                raise ClusterError(
                    f"`{key}` asks {amount:g} {name!r} for each of {count} bundle(s) but the Ray cluster "
                    f"has {custom.get(name, 0.0):g} in all: start nodes with `ray start --resources "
                    f"'{{\"{name}\": N}}'` or change `{key}`."
                )
    cpus = demand.servers * demand.server_cpus + demand.ranks * demand.trainer_cpus
    if cpus > cluster_cpus:
        raise ClusterError(
            f"the run needs {cpus:g} CPUs ({demand.servers} server(s) x {demand.server_cpus:g} + "
            f"{demand.ranks} trainer rank(s) x {demand.trainer_cpus:g}) but the Ray cluster has "
            f"{cluster_cpus:g}. Lower `ray_inference_cpus_per_worker`, `ray_trainer_cpus_per_worker`, "
            "`inference_num_workers` or `trainer_num_workers`."
        )
    if not cluster_gpus:
        return
    if colocate:
        if demand.tensor_parallel != 1:
            raise ClusterError(
                f"`colocate` shares each GPU between one server and one trainer rank, so servers are "
                f"single-GPU: set `inference_tensor_parallel_size: 1` (it is {demand.tensor_parallel}) "
                "or `colocate: false`."
            )
        if demand.colocated_gpus > cluster_gpus:
            raise ClusterError(
                f"colocated, the run needs {demand.colocated_gpus} GPU(s) (one per server and per "
                f"trainer rank, {demand.servers} server(s) and {demand.ranks} rank(s) sharing them) "
                f"but the Ray cluster has {cluster_gpus:g}. Lower `inference_num_workers` or "
                "`trainer_num_workers`."
            )
        return
    if demand.split_gpus > cluster_gpus:
        raise ClusterError(
            f"the run needs {demand.split_gpus} GPUs ({demand.servers * demand.tensor_parallel} for "
            f"inference + {demand.ranks} for training) but the Ray cluster has {cluster_gpus:g}. "
            "Set `colocate: true` (or `auto`) to share GPUs between servers and trainer ranks, or "
            "lower `inference_num_workers` or `trainer_num_workers`."
        )


@dataclass(frozen=True)
class Placement:
    """The reservations of a run's servers and trainer ranks, and the placement groups behind them
    (one when colocated) with the names the topology snapshot gives them."""

    colocated: bool
    servers: Reservation
    trainers: Reservation
    groups: list[tuple[str, Reservation]]

    def release(self) -> None:
        """Give the run's placement groups back. Ray frees them only when their driver disconnects, and
        a run that joined a connected session (a notebook, a test) leaves it connected."""
        for _, reservation in self.groups:
            remove_placement_group(reservation.group)


def place(cfg: Any, run_tag: str) -> Placement:
    """Check the run against the cluster, then reserve its placement group(s) and wait for them."""
    total = ray.cluster_resources()
    cluster_cpus, cluster_gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    demand = Demand.of(cfg)
    shared = colocated(cfg.colocate, demand, cluster_gpus)
    check_fits(demand, shared, cluster_cpus, cluster_gpus, total)
    timeout_s = cfg.ray_placement_timeout_s
    has_gpu = cluster_gpus > 0
    if shared:
        bundles = [
            {
                "CPU": demand.server_cpus * (i < demand.servers) + demand.trainer_cpus * (i < demand.ranks),
                **({"GPU": 1.0} if has_gpu else {}),
                **demand.bundle_resources(i),
            }
            for i in range(demand.colocated_gpus)
        ]
        group = reserve_bundles(
            "servers and trainer ranks", bundles, cfg.ray_inference_placement_strategy, timeout_s, run_tag
        )
        share = _GPU_SHARE if has_gpu else 0.0
        servers = Reservation(group=group, cpus=demand.server_cpus, gpus=share, count=demand.servers)
        trainers = Reservation(group=group, cpus=demand.trainer_cpus, gpus=share, count=demand.ranks)
        return Placement(True, servers, trainers, [("servers and trainer ranks (colocated)", servers)])
    servers = reserve(
        "inference servers",
        demand.servers,
        demand.server_cpus,
        demand.tensor_parallel if has_gpu else 0,
        cfg.ray_inference_placement_strategy,
        timeout_s,
        "ray_inference_cpus_per_worker",
        "inference_num_workers",
        run_tag,
        resources=demand.server_resources,
    )
    try:
        trainers = reserve(
            "trainer ranks",
            demand.ranks,
            demand.trainer_cpus,
            1 if has_gpu else 0,
            cfg.ray_trainer_placement_strategy,
            timeout_s,
            "ray_trainer_cpus_per_worker",
            "trainer_num_workers",
            run_tag,
            resources=demand.trainer_resources,
        )
    except BaseException:
        remove_placement_group(servers.group)  # the run stops here: release what it holds
        raise
    return Placement(False, servers, trainers, [("inference servers", servers), ("trainer ranks", trainers)])
