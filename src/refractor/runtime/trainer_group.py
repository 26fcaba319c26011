"""Trainer ranks as Ray actors, and the orchestrator-facing handle that drives them.

Each actor is one torch.distributed rank (NCCL on GPU, gloo on CPU) wrapping
:class:`refractor.trainer.Trainer`, built from the :class:`TrainerSettings` that the group reads
once from the config. Rank 0 also owns the :class:`WeightSender` that pushes the new weights into
the inference servers after every step; the other ranks take part in the bucket gathers.
:class:`RayTrainerGroup` packs each step's samples once on the driver (``PackingSettings``) and
gives every rank the same :class:`TrainBatch`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from refractor.algorithms.packing import PackingSettings, pack_step
from refractor.records import StepResult, TimelineEvent, TrainSample
from refractor.runtime.cluster import LOOPBACK, Reservation
from refractor.runtime.health import await_ranks, await_ref
from refractor.telemetry.log_capture import LogBatch, ProcessLogs
from refractor.telemetry.torch_memory import TorchMemoryRecorder, torch_memory_gb
from refractor.trainer.memory_plan import DEFAULT_MEMORY_FRACTION
from refractor.trainer.settings import TrainerSettings
from refractor.trainer.timing import StepTimer
from refractor.weight_sync import SyncReport, UpdateTarget, WeightSyncSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerGroupSettings:
    """What the trainer group reads from the config: each rank's settings, rank 0's weight sender,
    packing, the call deadline."""

    trainer: TrainerSettings
    weight_sync: WeightSyncSettings
    packing: PackingSettings
    call_timeout_s: float  # trainer_call_timeout_s: a rank that does not answer by then failed
    # where rank 0 listens for the ranks' rendezvous and for the weight-transfer group; None: its
    # node's address (ranks or servers on other nodes must reach it), else loopback on one node
    rendezvous_host: str | None = None
    weight_transfer_host: str | None = None
    torch_memory_interval_s: float = 0.1  # torch_memory_sample_interval_seconds (CUDA ranks only)
    # colocated servers sleep while the ranks step: each rank hands its cached GPU memory back to the
    # driver after a step and after a push, so the waking servers find it free
    release_gpu_cache: bool = False

    @classmethod
    def from_config(
        cls,
        cfg: Any,
        pad_token_id: int,
        *,
        control_token: str | None = None,
        single_node: bool = False,
        colocated: bool = False,
        servers_sleep: bool = False,
    ) -> TrainerGroupSettings:
        """``control_token``: the run's secret for the servers' control routes (not a config key).
        ``colocated``: servers share the ranks' GPUs; NCCL refuses two members of one communicator on
        the same GPU ("Duplicate GPU detected"), so weight updates go over gloo: as CUDA IPC handles
        when the run's one server shares trainer rank 0's GPU, else through host memory.
        ``servers_sleep``: the servers sleep while the ranks step (the ranks free their cached memory)."""
        loopback_transfer = single_node and cfg.ray_broadcast_prefer_loopback_if_single_node
        weight_sync = WeightSyncSettings.from_config(cfg, control_token)
        if colocated:
            weight_sync = replace(weight_sync, cpu_staging=True, cuda_ipc=cfg.num_inference_servers == 1)
        trainer = TrainerSettings.from_config(cfg)
        if trainer.trainer_memory_fraction is None:  # what activation_checkpointing: auto plans for
            engine_share = cfg.engine_memory_share(colocated) if colocated and not servers_sleep else 0.0
            trainer = replace(
                trainer, trainer_memory_fraction=max(DEFAULT_MEMORY_FRACTION - engine_share, 0.1)
            )
        return cls(
            trainer=trainer,
            weight_sync=weight_sync,
            packing=PackingSettings.from_config(cfg, pad_token_id),
            call_timeout_s=float(cfg.trainer_call_timeout_s),
            torch_memory_interval_s=float(cfg.torch_memory_sample_interval_seconds),
            rendezvous_host=LOOPBACK if single_node else None,
            weight_transfer_host=LOOPBACK if loopback_transfer else None,
            release_gpu_cache=servers_sleep,
        )


# ``drain_logs`` and ``drain_torch_memory`` run in their own thread, beside a train step in progress
@ray.remote(max_restarts=0, concurrency_groups={"telemetry": 1})
class TrainerActor:
    """One trainer rank. Construction is cheap; ``setup`` joins the process group and loads the model.
    Its Python logging and its stdout/stderr are kept for the driver's log collector."""

    def __init__(self, group: TrainerGroupSettings, rank: int, world_size: int) -> None:
        self.logs = ProcessLogs("trainer", rank, ray.util.get_node_ip_address(), capture_streams=True)
        self.settings = group.trainer
        self.weight_sync = group.weight_sync
        self.rendezvous_host = group.rendezvous_host or ray.util.get_node_ip_address()
        self.weight_transfer_host = group.weight_transfer_host or ray.util.get_node_ip_address()
        self.rank = rank
        self.world_size = world_size
        self.trainer = None
        self.sender = None
        self.memory: TorchMemoryRecorder | None = None
        self.torch_memory_interval_s = group.torch_memory_interval_s
        self.release_gpu_cache = group.release_gpu_cache
        # the version the trainer's weights are: the servers' label for them (a step trains version
        # `step` into `step + 1`; a resume pushes the checkpoint's version)
        self.version = 0

    @ray.method(concurrency_group="telemetry")
    def drain_logs(self) -> LogBatch:
        return self.logs.drain()

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 picks the address and a free port for the default process group."""
        with socket.socket() as s:
            s.bind((self.rendezvous_host, 0))
            return self.rendezvous_host, s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        from refractor.trainer import build_trainer

        self.trainer = build_trainer(
            self.settings, self.rank, self.world_size, master_addr=master_addr, master_port=master_port
        )
        node = ray.util.get_node_ip_address()
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        self.trainer.timeline_attrs = {"node": node, "gpu": gpu_ids[0] if gpu_ids else None}
        device = self.trainer.device
        if device.type == "cuda":
            self.memory = TorchMemoryRecorder(lambda: torch_memory_gb(device), self.torch_memory_interval_s)
            self.memory.start()
        return {
            "rank": self.rank,
            "device": str(self.trainer.device),
            "node": node,
            "gpu_ids": gpu_ids,
            "num_parameters": self.trainer.num_parameters,  # the whole model's, on every rank
            "impl": self.trainer.impl,
        }

    def init_weight_sync(self, servers: list[tuple[str, str]], eval_servers: list[str]) -> None:
        if self.rank != 0:
            return
        from refractor.weight_sync import ServerRef, WeightSender

        refs = [ServerRef(name, url) for name, url in servers]
        self.sender = WeightSender(
            refs,
            self.weight_sync,
            eval_servers=eval_servers,
            master_address=self.weight_transfer_host,
            device=self.trainer.device,
        )
        self.sender.init()

    def train_step(self, batch) -> StepResult:
        result = self.trainer.train_step(batch)
        self.version = batch.step + 1
        self._release_gpu_cache()
        return result

    def _release_gpu_cache(self) -> None:
        if self.release_gpu_cache and self.trainer.device.type == "cuda":
            torch.cuda.empty_cache()

    def sync_weights(self, version: int, target: UpdateTarget) -> SyncReport | None:
        """Every rank gathers the buckets; rank 0 pushes them and reports (the others return None)."""
        self.version = version
        return self._push(lambda buckets: self.sender.push(buckets, version, target))

    def refresh_server(self, name: str, url: str) -> tuple[int, SyncReport | None]:
        """Server ``name`` was restarted at ``url``: give it the weights the trainer holds now, as
        the version they are. Returns that version and rank 0's report (the others' is None)."""
        version = self.version

        def push(buckets):
            self.sender.replace_server(name, url)
            return self.sender.push_to_restarted(name, buckets, version)

        return version, self._push(push)

    def _push(self, push) -> SyncReport | None:
        start = time.time()
        buckets = self.trainer.export_weight_buckets()
        if self.rank != 0:
            for _ in buckets:  # take part in the gathers
                pass
            return None
        result = push(buckets)
        self._release_gpu_cache()
        return SyncReport.of_push(start, time.time(), result, {"rank": 0, **self.trainer.timeline_attrs})

    def save_checkpoint(self, step: int, orchestrator_state: dict[str, Any]) -> list[TimelineEvent]:
        """Every rank saves its part; returns this rank's ``checkpoint`` spans (wall clock)."""
        extra = {"orchestrator.json": json.dumps(orchestrator_state)}
        timer = StepTimer(
            torch.device("cpu"), attrs={"step": step, "rank": self.rank, **self.trainer.timeline_attrs}
        )
        with timer.span("checkpoint"):
            self.trainer.save_checkpoint(step, extra_files=extra, timer=timer)
        return timer.finish()[0]

    def load_checkpoint(self, which) -> int:
        return self.trainer.load_checkpoint(which)

    def read_checkpoint_file(self, step: int, name: str) -> str | None:
        from refractor.trainer.checkpoint import checkpoint_path

        path = checkpoint_path(self.trainer.checkpoint_dir, step) / name
        return path.read_text() if path.exists() else None

    @ray.method(concurrency_group="telemetry")
    def drain_torch_memory(self) -> dict[str, Any]:
        """The torch-memory samples since the last drain (none on CPU), with the rank's node,
        the samples dropped from a full buffer and why sampling stopped, if it did."""
        memory = self.memory
        return {
            "node": self.trainer.timeline_attrs["node"],
            "samples": [] if memory is None else memory.drain(),
            "dropped": 0 if memory is None else memory.dropped,
            "error": None if memory is None else memory.error,
        }

    def shutdown(self) -> None:
        if self.memory is not None:
            self.memory.stop()
        if self.sender is not None:
            self.sender.close()
        if self.trainer is not None:
            self.trainer.shutdown()


class RayTrainerGroup:
    """What the orchestrator calls (``train_step``, ``update_weights``, ``save_checkpoint``), on Ray."""

    def __init__(self, settings: TrainerGroupSettings, reservation: Reservation) -> None:
        self.settings = settings
        self.call_timeout_s = self.settings.call_timeout_s
        self.world_size = reservation.count
        self.on_gpu = False  # known after setup
        self.actors = [
            TrainerActor.options(
                num_cpus=reservation.cpus,
                num_gpus=reservation.gpus,
                name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    reservation.group, placement_group_bundle_index=rank
                ),
            ).remote(self.settings, rank, self.world_size)
            for rank in range(self.world_size)
        ]

    # --- start-up (blocking; called from the driver before the event loop) ---
    def setup(self) -> list[dict[str, Any]]:
        addr, port = ray.get(self.actors[0].rendezvous_address.remote())
        infos = ray.get([a.setup.remote(addr, port) for a in self.actors])
        self.on_gpu = any(i["device"].startswith("cuda") for i in infos)
        return infos

    def init_weight_sync(self, servers: list[tuple[str, str]], eval_servers: list[str]) -> None:
        ray.get([a.init_weight_sync.remote(servers, eval_servers) for a in self.actors])

    def load_checkpoint(self, which) -> int:
        steps = ray.get([a.load_checkpoint.remote(which) for a in self.actors])
        return steps[0]

    def read_checkpoint_file(self, step: int, name: str) -> str | None:
        return ray.get(self.actors[0].read_checkpoint_file.remote(step, name))

    # --- the orchestrator's Trainer protocol ---
    async def train_step(self, step: int, samples: list[TrainSample]) -> StepResult:
        # the ranks of a model replica (context-parallel group, Megatron TP x PP) share their rows
        dp_size = self.settings.trainer.data_parallel_size(self.world_size)
        batch = await asyncio.to_thread(pack_step, samples, step, self.settings.packing, dp_size)
        batch_ref = ray.put(batch)
        results = await await_ranks(
            [a.train_step.remote(batch_ref) for a in self.actors],
            f"train_step (step {step})",
            self.call_timeout_s,
        )
        result = results[0]
        result.metrics.update(batch.metrics)
        for other in results[1:]:
            result.timeline.extend(other.timeline)
        return result

    async def update_weights(
        self, version: int, target: UpdateTarget = UpdateTarget.FULL
    ) -> list[TimelineEvent]:
        target = UpdateTarget(target)
        reports = await await_ranks(
            [a.sync_weights.remote(version, target) for a in self.actors],
            f"the weight sync to version {version}",
            self.call_timeout_s,
        )
        return reports[0].timeline_events(version, target)

    async def refresh_server(self, name: str, url: str) -> list[TimelineEvent]:
        """Push the current weights to the restarted server ``name`` (now at ``url``), canary
        checked; it is in every later update. Queued behind a train step in progress, so the
        server gets the newest weights under their own version."""
        results = await await_ranks(
            [a.refresh_server.remote(name, url) for a in self.actors],
            f"the weight push to the restarted server {name}",
            self.call_timeout_s,
        )
        version, report = results[0]
        return report.timeline_events(version, UpdateTarget.RESTARTED)

    async def save_checkpoint(self, step: int, orchestrator_state: dict[str, Any]) -> list[TimelineEvent]:
        """Every rank's ``checkpoint`` spans."""
        spans = await await_ranks(
            [a.save_checkpoint.remote(step, orchestrator_state) for a in self.actors],
            f"the checkpoint of step {step}",
            self.call_timeout_s,
        )
        return [event for rank in spans for event in rank]

    def shutdown(self, timeout_s: float = 30.0) -> None:
        with contextlib.suppress(Exception):  # best effort; the actors are killed next
            ray.get([a.shutdown.remote() for a in self.actors], timeout=timeout_s)
        for a in self.actors:
            ray.kill(a, no_restart=True)


class TrainerMemoryLoop:
    """Every ``interval_s`` (``ray_torch_memory_drain_interval_seconds``) drains each CUDA rank's
    torch-memory samples into ``log_metrics(source, metrics, timestamp, node)`` as source
    ``torch:trainer-<rank>`` (docs/metrics.md#system-metrics). With no rank on a GPU it says so
    once and ends. A rank that cannot be drained, or whose sampling stopped, is recorded once as a
    ``torch_memory_failed`` warning event and left out from then on; the run goes on."""

    def __init__(
        self,
        group: RayTrainerGroup,
        log_metrics: Callable[..., None],
        warn: Callable[[TimelineEvent], None],
        interval_s: float,
        call_timeout_s: float = 30.0,
    ) -> None:
        self.group = group
        self.log_metrics = log_metrics
        self.warn = warn
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self.ranks = dict(enumerate(group.actors))
        self.dropped: dict[int, int] = {}

    async def run(self) -> None:
        if not self.group.on_gpu:
            log.info("torch memory is not sampled: no trainer rank runs on a GPU")
            return
        while self.ranks:
            await asyncio.sleep(self.interval_s)
            await self.collect()

    async def collect(self) -> None:
        ranks = list(self.ranks)
        results = await asyncio.gather(
            *(
                asyncio.wait_for(await_ref(self.ranks[r].drain_torch_memory.remote()), self.call_timeout_s)
                for r in ranks
            ),
            return_exceptions=True,
        )
        for rank, result in zip(ranks, results, strict=True):
            if isinstance(result, BaseException):
                self._stopped(rank, f"{type(result).__name__}: {result}")
                continue
            for timestamp, metrics in result["samples"]:
                self.log_metrics(f"torch:trainer-{rank}", metrics, timestamp, node=result["node"])
            if result["dropped"] > self.dropped.get(rank, 0):
                self.dropped[rank] = result["dropped"]
                log.warning("trainer rank %d dropped %d torch-memory samples", rank, result["dropped"])
            if result["error"] is not None:
                self._stopped(rank, result["error"])

    def _stopped(self, rank: int, reason: str) -> None:
        self.ranks.pop(rank, None)
        message = f"torch memory of trainer rank {rank} is no longer sampled: {reason}"[:2000]
        log.warning(message)
        now = time.time()
        self.warn(
            TimelineEvent("torch_memory_failed", now, now, "driver", {"rank": rank, "message": message})
        )
