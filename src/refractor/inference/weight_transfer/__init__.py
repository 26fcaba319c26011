"""Trainer -> inference weight updates: one contract for vLLM and the native engine.

Control plane: vLLM 0.32's weight-transfer routes (``control.py``; the native server gets them from
``native_router.weight_transfer_router``). Data plane: bucketed broadcasts over a dedicated
stateless gloo/NCCL group (``group.py``, ``protocol.py``). Trainer side: ``WeightSender``.
"""

from refractor.inference.weight_transfer.buckets import TensorMeta, iter_buckets, plan_buckets
from refractor.inference.weight_transfer.control import ServerRef, WeightSyncError
from refractor.inference.weight_transfer.native_router import weight_transfer_router
from refractor.inference.weight_transfer.protocol import SendStats, WorkerReport
from refractor.inference.weight_transfer.sender import (
    FULL,
    TRAINING_ONLY,
    CanaryError,
    PushResult,
    WeightSender,
    check_canary,
)

__all__ = [
    "FULL",
    "TRAINING_ONLY",
    "CanaryError",
    "PushResult",
    "SendStats",
    "ServerRef",
    "TensorMeta",
    "WeightSender",
    "WeightSyncError",
    "WorkerReport",
    "check_canary",
    "iter_buckets",
    "plan_buckets",
    "weight_transfer_router",
]
