"""A dedicated, stateless process group between the trainer (rank 0) and inference workers.

"Stateless": built directly from a TCPStore, never through ``torch.distributed.init_process_group``,
so it coexists with the trainer's FSDP world and with the groups vLLM creates in its workers.
The trainer hosts the store. NCCL moves device tensors on GPU; gloo moves host tensors.

Every collective is bounded in time: gloo raises after ``timeout``; NCCL work is polled against
a deadline from the CPU (a NCCL collective with a dead peer would otherwise block forever) and
the communicator is aborted when the deadline passes.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

Backend = Literal["gloo", "nccl"]
_STORE_PREFIX = "refractor-weight-transfer"


class CollectiveTimeout(RuntimeError):
    """A collective of the weight-transfer group did not complete in time."""


class TransferGroup:
    def __init__(
        self, pg, store, backend: Backend, rank: int, world_size: int, device: torch.device, timeout_s: float
    ):
        self._pg = pg
        self._store = store  # the group needs its store alive
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s
        self.broken = False

    @classmethod
    def create(
        cls,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: Backend,
        group_name: str,
        device: torch.device | str | None = None,
        init_timeout_s: float = 300.0,
        timeout_s: float = 300.0,
        store: dist.TCPStore | None = None,
    ) -> TransferGroup:
        """Join (rank > 0) or host (rank 0) the group. Blocks until every rank has joined.

        Rank 0 may pass a ``store`` it created beforehand (``host_store``), e.g. to learn a port
        picked by the OS before telling the workers where to connect.
        """
        init_timeout = timedelta(seconds=init_timeout_s)
        if store is None and rank == 0:
            store = host_store(master_address, world_size, init_timeout_s, master_port)
        elif store is None:
            store = dist.TCPStore(
                master_address,
                master_port,
                world_size,
                is_master=rank == 0,
                timeout=init_timeout,
                wait_for_workers=False,
            )
        prefixed = dist.PrefixStore(f"{_STORE_PREFIX}/{group_name}", store)
        if backend == "gloo":
            device = torch.device("cpu")
            options = dist.ProcessGroupGloo._Options()
            options._timeout = init_timeout
            options._devices = [_gloo_device(master_address)]
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
            pg.set_timeout(timedelta(seconds=timeout_s))
        elif backend == "nccl":
            device = torch.device(device if device is not None else "cuda")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)  # NCCL binds its communicator to the current device
            options = dist.ProcessGroupNCCL.Options()
            # generous: our own deadline (timeout_s) fires first and aborts the communicator, so
            # NCCL's watchdog never tears the whole process down
            options._timeout = timedelta(seconds=max(init_timeout_s, timeout_s) * 4)
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            group = cls(pg, store, backend, rank, world_size, device, timeout_s)
            # NCCL communicators are created lazily: a first tiny collective is the rendezvous
            group.broadcast(torch.zeros(1, device=device), timeout_s=init_timeout_s)
            return group
        else:
            raise ValueError(f"unknown weight-transfer backend {backend!r} (expected 'gloo' or 'nccl')")
        return cls(pg, store, backend, rank, world_size, device, timeout_s)

    # --- collectives -----------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int = 0, timeout_s: float | None = None) -> None:
        self.wait(self.broadcast_async(tensor, src), timeout_s)

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0):
        """Start a broadcast; the caller keeps ``tensor`` alive and ``wait``s on the returned work."""
        if self.broken:
            raise CollectiveTimeout("the weight-transfer group failed earlier; create a new one")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self._pg.broadcast([tensor], opts)

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Gather one equally-shaped tensor per rank onto ``dst`` (returns None elsewhere)."""
        opts = dist.GatherOptions()
        opts.rootRank = dst
        outputs = [[torch.empty_like(tensor) for _ in range(self.world_size)]] if self.rank == dst else []
        self.wait(self._pg.gather(outputs, [tensor], opts))
        return outputs[0] if self.rank == dst else None

    def wait(self, work, timeout_s: float | None = None) -> None:
        timeout_s = timeout_s or self.timeout_s
        if self.backend == "gloo":
            try:
                work.wait()  # bounded by the group's timeout
            except Exception as err:  # noqa: BLE001 - gloo raises RuntimeError subclasses
                self.broken = True
                raise CollectiveTimeout(f"gloo collective failed: {err}") from err
            return
        deadline = time.monotonic() + timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                self.broken = True
                self.abort()
                raise CollectiveTimeout(f"NCCL collective did not complete within {timeout_s:.0f} s")
            time.sleep(0.0002)
        work.wait()

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # best effort on an already failed communicator
            self._pg.abort()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Release the communicator without ever blocking the caller for long: a NCCL shutdown
        waits for its peers, which may be gone, so NCCL groups are aborted instead."""
        release = self._pg.abort if self.backend == "nccl" else self._pg.shutdown

        def run() -> None:
            with contextlib.suppress(Exception):
                release()

        thread = threading.Thread(target=run, name="weight-transfer-shutdown", daemon=True)
        thread.start()
        thread.join(timeout_s)


def check_worker_join(rank: int, world_size: int, master_port: int, backend: str) -> None:
    """Validate the group an inference worker is asked to join (ValueError naming the field).

    A worker always joins as a client, rank >= 1: rank 0 (which hosts the store and listens) is
    the trainer's, so no request can make a server listen on a port of the caller's choosing.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 1 <= master_port <= 65535:
        raise ValueError(f"master_port must be in 1..65535, got {master_port}")
    if not 1 <= rank < world_size:
        raise ValueError(
            f"a worker's rank must be in 1..world_size-1 (rank 0 is the trainer's); got rank {rank} "
            f"of world_size {world_size}"
        )


def check_worker_device(backend: str, payload: str, device: torch.device) -> None:
    """Validate that a worker on ``device`` can take part as asked (ValueError naming the field):
    NCCL and CUDA IPC payloads need a CUDA worker."""
    if payload not in ("group", "cuda_ipc"):
        raise ValueError(f"payload must be 'group' or 'cuda_ipc', got {payload!r}")
    for name, value, cuda_only in (("backend", backend, "nccl"), ("payload", payload, "cuda_ipc")):
        if value == cuda_only and device.type != "cuda":
            raise ValueError(f"{name} {value!r} needs a CUDA engine, this one runs on {device}")


def host_store(master_address: str, world_size: int, init_timeout_s: float, port: int = 0) -> dist.TCPStore:
    """Rank 0's store, listening on ``master_address`` only; ``port=0`` lets the OS pick a free port
    (read it back from ``store.port``).

    torch's store listens on every interface whatever address it is given, so the listening socket
    is bound here and handed over: a store meant for one machine is unreachable from the network.
    """
    family = socket.AF_INET6 if ":" in master_address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((master_address, port))
        sock.listen(max(128, world_size))
        bound_port = sock.getsockname()[1]
    except OSError as err:
        sock.close()
        raise OSError(f"cannot listen on {master_address}:{port} for the rendezvous store: {err}") from err
    return dist.TCPStore(
        master_address,
        bound_port,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=init_timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),  # the store owns (and closes) the socket from here on
    )


def _gloo_device(master_address: str):
    # on one node bind gloo to loopback; elsewhere let gloo resolve this host's address
    if master_address in ("127.0.0.1", "localhost"):
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()
