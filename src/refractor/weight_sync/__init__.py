"""Trainer -> inference weight updates: one contract for vLLM and the native engine.

- ``sender``: trainer rank 0 drives an update (``WeightSender(servers, settings).push``).
- ``control_plane``: the HTTP calls to each server's weight-update routes (vLLM's, or the native
  server's from ``refractor.inference.weight_routes``).
- ``data_plane``: the bucket broadcast stream, its receiver (run by every inference worker) and
  the canary checksum, over a ``process_group`` (a dedicated stateless gloo/NCCL group).
- ``buckets``: grouping named tensors into bounded dtype-homogeneous buckets.
- ``gather``: the trainer ranks' full-weight buckets from FSDP shards (import it from
  ``refractor.weight_sync.gather``; it needs the trainer's model code).
- ``settings`` / ``records``: the typed settings, targets and results crossing these seams.
"""

from refractor.weight_sync.buckets import TensorMeta, iter_buckets, plan_buckets
from refractor.weight_sync.control_plane import ServerRef, WeightSyncError
from refractor.weight_sync.data_plane import SendStats, WorkerReport
from refractor.weight_sync.records import PushResult, SyncReport, UpdateTarget
from refractor.weight_sync.sender import CanaryError, WeightSender, check_canary
from refractor.weight_sync.settings import WeightSyncSettings

__all__ = [
    "CanaryError",
    "PushResult",
    "SendStats",
    "ServerRef",
    "SyncReport",
    "TensorMeta",
    "UpdateTarget",
    "WeightSender",
    "WeightSyncError",
    "WeightSyncSettings",
    "WorkerReport",
    "check_canary",
    "iter_buckets",
    "plan_buckets",
]
