"""Process-group setup for trainer ranks: NCCL on CUDA, gloo on CPU, one device per rank.

A rank is started either by torchrun (``RANK``/``WORLD_SIZE``/``MASTER_*`` in the environment), by
a Ray actor or a test (explicit rank, world size and rendezvous address). If a default process
group already exists (a test harness made it), it is reused as is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from refractor.weight_sync.process_group import host_store


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """The rank's device: explicit, else ``cuda:LOCAL_RANK`` when CUDA exists (Ray actors see one
    GPU), else CPU. A bare ``cuda`` also means this rank's GPU."""
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda" or device.index is not None:
            return device
    elif not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    return torch.device("cuda", local)


def init_distributed(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
    device: str | torch.device | None = None,
    timeout_s: float = 600.0,
) -> RankInfo:
    """Join (or create) the default process group and return this rank's identity.

    Missing arguments come from the torchrun environment variables; a single process with
    nothing set becomes rank 0 of a world of 1 (rendezvous on a free localhost port).
    """
    dev = pick_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        return RankInfo(dist.get_rank(), dist.get_world_size(), dev)
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"trainer rank {rank} is outside world_size {world_size}")
    addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = (
        master_port or int(os.environ.get("MASTER_PORT", 0)) or (_free_port() if world_size == 1 else 29500)
    )
    backend = "nccl" if dev.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    rendezvous: dict = {}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rendezvous["init_method"] = f"tcp://{addr}:{port}"  # torchrun's agent hosts the store
    elif rank == 0:  # rank 0 hosts the store, listening on `addr` only
        rendezvous["store"] = host_store(addr, world_size, timeout_s, port)
    else:
        rendezvous["store"] = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=dev if dev.type == "cuda" else None,
        **rendezvous,
    )
    return RankInfo(rank, world_size, dev)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce that is a no-op for a world of one (keeps single-rank runs cheap)."""
    if dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op)
    return tensor
