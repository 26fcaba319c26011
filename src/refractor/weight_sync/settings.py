"""The run config's weight-sync keys, as one typed record the sender takes.

Built from the validated run config (``WeightSyncSettings.from_config(cfg)``) or directly (tests,
benchmarks). Plain dataclass: GPU worker images import it without pydantic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from refractor.weight_sync.data_plane import BroadcastMode

InflightKv = Literal["recompute", "keep"]


@dataclass(frozen=True)
class WeightSyncSettings:
    broadcast_mode: BroadcastMode = "flattened_bucket"  # weight_broadcast_mode
    cpu_staging: bool = False  # weight_broadcast_cpu_staging: buckets travel over gloo, even from a GPU
    # every server of the group shares the sender's GPU (a colocated run's one server): buckets stay
    # in GPU memory and travel as CUDA IPC handles over gloo (cpu_staging's group); ignored on CPU
    cuda_ipc: bool = False
    init_timeout_s: float = 300.0  # creating a transfer group (rendezvous of trainer and workers)
    timeout_s: float = 300.0  # every collective and HTTP call of an update
    gather_before_pause_bytes: int = 4096 * 2**20  # weight_sync_gather_before_pause_mb, in bytes
    inflight_kv: InflightKv = "recompute"  # weight_sync_inflight_kv
    # the run's secret for the servers' control routes; never printed (repr) nor stored
    control_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.inflight_kv not in ("recompute", "keep"):
            raise ValueError(f"inflight_kv must be 'recompute' or 'keep', got {self.inflight_kv!r}")
        if self.gather_before_pause_bytes < 0:
            raise ValueError(f"gather_before_pause_bytes must be >= 0, got {self.gather_before_pause_bytes}")

    @classmethod
    def from_config(cls, cfg, control_token: str | None = None) -> WeightSyncSettings:
        """The weight-sync keys of a validated run config (``refractor.config``), and the run's
        control token (not a config key: a fresh secret per run)."""
        return cls(
            broadcast_mode=cfg.weight_broadcast_mode,
            cpu_staging=cfg.weight_broadcast_cpu_staging,
            init_timeout_s=float(cfg.ray_broadcast_init_timeout_s),
            timeout_s=float(cfg.ray_broadcast_init_timeout_s),
            gather_before_pause_bytes=cfg.weight_sync_gather_before_pause_mb * 2**20,
            inflight_kv=cfg.weight_sync_inflight_kv,
            control_token=control_token,
        )
