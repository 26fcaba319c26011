"""The data plane: how buckets travel from trainer rank 0 to every worker of a transfer group.

Contract: rank 0 runs ``BucketSender.send`` then ``gather_reports``; every other rank runs
``BucketReceiver.receive`` to its end, loads each bucket before asking for the next, then
``send_report``. Both sides keep the group's metadata history, so they must see the same streams.

Per bucket the sender broadcasts a small int64 header ``[kind, payload_bytes, meta_bytes,
n_tensors]``; when the bucket's metadata (names, dtypes, shapes) differs from what this group
received at the same bucket index before, the JSON metadata follows, otherwise both sides reuse
their cached copy (so the metadata travels once per group for a fixed model). Then the payload:
one flat byte buffer (``flattened_bucket``) or one broadcast per tensor (``per_tensor``). A header
of kind END closes the stream, after which every worker gathers a ``WorkerReport`` onto rank 0.

A sender made with an ``ipc_device`` (a GPU every worker of the group shares: a colocated run's one
server) packs each bucket there and broadcasts a CUDA IPC handle instead of the bytes (kind IPC:
the handle's length, then the handle, :mod:`.cuda_ipc`); each worker copies the bucket out of the
mapped memory, lets the mapping go, and gathers an acknowledgement, after which the sender reuses
that memory. The group itself (gloo) then carries only headers, metadata, handles and reports.

The canary checksum is computed by both sides on the bytes as they travel (the worker before any
loader transforms them), so it is independent of how an engine stores weights (vLLM's CPU
kernels repack them). It is an order-weighted sum of the bytes read as 64-bit words, modulo 2**64
(wrapping int64 arithmetic: associative, so every device and reduction order gives the same value,
and a native int64 sum runs at memory speed). A flipped bit, a missing/extra tensor or a
misplaced unit of transfer changes it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Literal

import torch

from refractor.errors import one_line
from refractor.weight_sync import cuda_ipc
from refractor.weight_sync.buckets import TensorMeta, dtype_from_name, split_by_dtype
from refractor.weight_sync.process_group import TransferGroup

BroadcastMode = Literal["flattened_bucket", "per_tensor"]
KIND_END = 0
KIND_FLAT = 1
KIND_PER_TENSOR = 2
KIND_IPC = 3  # a flattened bucket left in the sender's GPU memory; the payload is a CUDA IPC handle
_MODE_KIND = {"flattened_bucket": KIND_FLAT, "per_tensor": KIND_PER_TENSOR}
_MAX_IN_FLIGHT = 2  # payload broadcasts the sender keeps in flight (double buffering)
# Metadata takes about 100 bytes a tensor; a header announcing more than this is garbage, and the
# receive buffer would be allocated before anything else could be checked.
MAX_METADATA_BYTES = 64 << 20


class MalformedStream(ValueError):
    """A weight stream that breaks the data-plane protocol (the sender's fault, named in the message).

    The receiver cannot tell where the next unit of the stream starts, so the group it came through
    cannot carry further updates.
    """


def byte_checksum(data: torch.Tensor) -> torch.Tensor:
    """int64 scalar (on data's device): the bytes read as int64 words, summed modulo 2**64."""
    raw = data.detach().contiguous().view(-1).view(torch.uint8)
    if raw.data_ptr() % 8:
        raw = raw.clone()
    whole = raw.numel() // 8 * 8
    return raw[:whole].view(torch.int64).sum() + raw[whole:].sum(dtype=torch.int64)


class RunningChecksum:
    """Order-weighted combination of unit checksums, kept on device (no sync per bucket)."""

    def __init__(self, device: torch.device):
        self.value = torch.zeros((), dtype=torch.int64, device=device)
        self.units = 0

    def add(self, data: torch.Tensor) -> None:
        self.units += 1
        # a weight per position: units that arrive swapped or shifted change the sum
        self.value = self.value + (2 * self.units + 1) * byte_checksum(data)

    def item(self) -> int:
        return int(self.value.item())


@dataclass(frozen=True)
class WorkerReport:
    """What a worker received and loaded in one update; travels as an int64 vector."""

    rank: int
    checksum: int
    tensors: int
    bytes: int
    buckets: int
    params_loaded: int  # engine parameters written by this update (coverage check)
    params_total: int
    receive_us: int
    load_us: int

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> WorkerReport:
        return cls(*(int(v) for v in t.tolist()))

    @classmethod
    def empty_tensor(cls, device: torch.device) -> torch.Tensor:
        return torch.zeros(len(fields(cls)), dtype=torch.int64, device=device)


@dataclass(frozen=True)
class BucketTiming:
    """When the sender waited for one caller bucket and sent it (unix seconds). ``waited_from`` ->
    ``started``: getting the bucket from the caller (the trainer's gather of it, when not gathered
    ahead); ``started`` -> ``ended``: packing it and issuing its broadcasts (asynchronous: this
    includes waiting for the broadcasts in flight before it to finish)."""

    index: int
    waited_from: float
    started: float
    ended: float
    bytes: int


@dataclass(frozen=True)
class SendStats:
    checksum: int
    tensors: int
    bytes: int
    buckets: int
    metadata_sent: bool
    seconds: float
    bucket_timings: tuple[BucketTiming, ...] = ()
    drained_from: float = 0.0  # unix seconds: the last bucket was issued, and its broadcasts ...
    finished: float = 0.0  # ... had all finished
    # every byte rank 0 broadcast for this update: headers, metadata, payloads (or IPC handles), END
    wire_bytes: int = 0


# --- sender ----------------------------------------------------------------------------------
class BucketSender:
    """Trainer side of one group: streams buckets and remembers the metadata the group has."""

    def __init__(
        self,
        group: TransferGroup,
        mode: BroadcastMode = "flattened_bucket",
        ipc_device: torch.device | None = None,
    ):
        """``ipc_device``: the GPU every worker shares with this rank; buckets are then packed there
        and sent as CUDA IPC handles (always flattened, whatever ``mode`` says)."""
        if mode not in _MODE_KIND:
            raise ValueError(f"weight_broadcast_mode must be one of {sorted(_MODE_KIND)}, got {mode!r}")
        if ipc_device is not None and ipc_device.type != "cuda":
            raise ValueError(f"CUDA IPC buckets need a CUDA device, got {ipc_device}")
        self.group = group
        self.mode = mode
        self.ipc_device = ipc_device
        self._known_metadata: list[list[TensorMeta]] = []

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], corrupt: bool = False) -> SendStats:
        """Broadcast every bucket, then the END header. ``corrupt`` flips one payload byte after
        checksumming; it exists only so tests can prove that the canary catches transport damage."""
        start = time.perf_counter()
        g = self.group
        ipc = self.ipc_device
        checksum = RunningChecksum(g.device if ipc is None else ipc)
        kind = KIND_IPC if ipc is not None else _MODE_KIND[self.mode]
        in_flight: list = []  # (work, tensors kept alive until the work completes)
        tensors = 0
        nbytes = 0
        index = 0
        metadata_sent = False
        timings: list[BucketTiming] = []
        waited_from = time.time()
        wire_bytes = 0

        def issue(tensor: torch.Tensor) -> None:
            nonlocal wire_bytes
            wire_bytes += tensor.numel() * tensor.element_size()
            in_flight.append((g.broadcast_async(tensor), tensor))

        def drain(keep: int) -> None:
            while len(in_flight) > keep:
                g.wait(in_flight.pop(0)[0])

        with torch.no_grad():
            for caller_bucket in buckets:
                started = time.time()
                caller_bytes = 0
                for bucket in split_by_dtype(caller_bucket):
                    metas = [TensorMeta.of(name, t) for name, t in bucket]
                    meta_blob = b""
                    if index >= len(self._known_metadata) or self._known_metadata[index] != metas:
                        meta_blob = json.dumps([[m.name, m.dtype, list(m.shape)] for m in metas]).encode()
                        metadata_sent = True
                    bucket_bytes = sum(m.nbytes for m in metas)
                    issue(
                        torch.tensor(
                            [kind, bucket_bytes, len(meta_blob), len(metas)],
                            dtype=torch.int64,
                            device=g.device,
                        )
                    )
                    if meta_blob:
                        issue(torch.frombuffer(bytearray(meta_blob), dtype=torch.uint8).to(g.device))
                    if ipc is not None:
                        corrupt = self._send_handle([t for _, t in bucket], checksum, issue, drain, corrupt)
                        payloads = []
                    else:
                        payloads = (
                            [_pack([t for _, t in bucket], g.device)]
                            if self.mode == "flattened_bucket"
                            else [t.detach().to(g.device).contiguous() for _, t in bucket]
                        )
                    for payload in payloads:
                        drain(2 * _MAX_IN_FLIGHT)
                        if corrupt:
                            checksum.add(payload)
                            payload = _damaged(payload)
                            corrupt = False
                            issue(payload)
                        else:
                            issue(payload)
                            checksum.add(payload)  # reads the buffer while it is on the wire
                    self._record_metadata(index, metas)
                    tensors += len(metas)
                    nbytes += bucket_bytes
                    caller_bytes += bucket_bytes
                    index += 1
                ended = time.time()
                timings.append(BucketTiming(len(timings), waited_from, started, ended, caller_bytes))
                waited_from = ended
            drained_from = time.time()
            issue(torch.tensor([KIND_END, 0, 0, 0], dtype=torch.int64, device=g.device))
            drain(0)
        finished = time.time()
        return SendStats(
            checksum.item(),
            tensors,
            nbytes,
            index,
            metadata_sent,
            time.perf_counter() - start,
            tuple(timings),
            drained_from,
            finished,
            wire_bytes,
        )

    def _send_handle(
        self, tensors: list[torch.Tensor], checksum: RunningChecksum, issue, drain, corrupt: bool
    ) -> bool:
        """One bucket as a CUDA IPC handle; returns after every worker has copied it out (the
        acknowledgement gather), so the memory may be reused. Returns whether ``corrupt`` is still
        pending (it applies to the first bucket)."""
        payload = _pack(tensors, self.ipc_device)
        checksum.add(payload)
        if corrupt:
            payload = _damaged(payload)
            corrupt = False
        handle = cuda_ipc.export_bucket(payload)
        issue(torch.tensor([len(handle)], dtype=torch.int64, device=self.group.device))
        issue(torch.frombuffer(bytearray(handle), dtype=torch.uint8).to(self.group.device))
        drain(0)
        acks = self.group.gather(torch.zeros(1, dtype=torch.int64, device=self.group.device))
        failed = [rank for rank, ack in enumerate(acks or []) if rank > 0 and int(ack.item())]
        if failed:
            raise RuntimeError(f"weight transfer: worker rank(s) {failed} could not map a CUDA IPC bucket")
        return corrupt

    def _record_metadata(self, index: int, metas: list[TensorMeta]) -> None:
        if index < len(self._known_metadata):
            self._known_metadata[index] = metas
        else:
            self._known_metadata.append(metas)

    def gather_reports(self) -> list[WorkerReport]:
        """Reports of ranks 1..N (call after ``send``; every worker sends one)."""
        g = self.group
        rows = g.gather(WorkerReport.empty_tensor(g.device))
        assert rows is not None
        return [WorkerReport.from_tensor(row.cpu()) for row in rows[1:]]


def _damaged(payload: torch.Tensor) -> torch.Tensor:
    """A copy of ``payload`` with its first byte flipped (``send(corrupt=True)``, for tests)."""
    out = payload.clone()
    out.view(-1).view(torch.uint8)[0] ^= 0xFF
    return out


def _pack(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    parts = [t.detach().to(device).contiguous().view(-1).view(torch.uint8) for t in tensors]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# --- receiver --------------------------------------------------------------------------------
class BucketReceiver:
    """Worker side of one group: yields received buckets as (name, tensor) lists.

    Tensors of a flattened bucket are views of one receive buffer, valid until the loader is done
    with them; the caller loads each bucket before asking for the next one.
    """

    def __init__(self, group: TransferGroup, ipc_device: torch.device | None = None):
        """``ipc_device``: this worker's GPU, where buckets sent as CUDA IPC handles are mapped and
        copied to (None: a bucket sent that way is a ``MalformedStream``)."""
        self.group = group
        self.ipc_device = ipc_device
        self._known_metadata: list[list[TensorMeta]] = []
        self.reset_stats()

    def reset_stats(self) -> None:
        self.checksum = RunningChecksum(self.group.device if self.ipc_device is None else self.ipc_device)
        self.tensors = 0
        self.bytes = 0
        self.buckets = 0
        self.receive_s = 0.0

    def receive(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield each bucket of one update until the END header. Raises ``MalformedStream`` on a
        header or metadata that breaks the protocol, before allocating anything it announces."""
        g = self.group
        self.reset_stats()
        while True:
            t0 = time.perf_counter()
            header = torch.empty(4, dtype=torch.int64, device=g.device)
            g.broadcast(header)
            kind, payload_bytes, meta_bytes, n_tensors = header.tolist()
            if kind == KIND_END:
                self.receive_s += time.perf_counter() - t0
                return
            index = self.buckets
            _check_header(index, kind, payload_bytes, meta_bytes, n_tensors)
            if meta_bytes:
                blob = torch.empty(meta_bytes, dtype=torch.uint8, device=g.device)
                g.broadcast(blob)
                metas = _parse_metadata(index, blob.cpu().numpy().tobytes())
                if index < len(self._known_metadata):
                    self._known_metadata[index] = metas
                else:
                    self._known_metadata.append(metas)
            elif index < len(self._known_metadata):
                metas = self._known_metadata[index]
            else:
                raise MalformedStream(
                    f"weight transfer: bucket {index} arrived without metadata and none is "
                    "cached (the trainer and this worker disagree about the group's history)"
                )
            if len(metas) != n_tensors or sum(m.nbytes for m in metas) != payload_bytes:
                raise MalformedStream(
                    f"weight transfer: bucket {index} header ({n_tensors} tensors, "
                    f"{payload_bytes} bytes) does not match its metadata"
                )
            received = self._receive_payload(kind, metas)
            self.receive_s += time.perf_counter() - t0
            self.tensors += len(metas)
            self.bytes += payload_bytes
            self.buckets += 1
            yield received

    def _receive_payload(self, kind: int, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
        g = self.group
        if kind in (KIND_FLAT, KIND_IPC):
            nbytes = sum(m.nbytes for m in metas)
            if kind == KIND_IPC:
                buffer = self._copy_mapped(nbytes)
            else:
                buffer = _allocate((nbytes,), torch.uint8, g.device)
                g.broadcast(buffer)
            self.checksum.add(buffer)
            out = []
            offset = 0
            for m in metas:
                view = buffer[offset : offset + m.nbytes].view(dtype_from_name(m.dtype)).view(m.shape)
                out.append((m.name, view))
                offset += m.nbytes
            return out
        out = []
        for m in metas:
            tensor = _allocate(m.shape, dtype_from_name(m.dtype), g.device)
            g.broadcast(tensor)
            self.checksum.add(tensor)
            out.append((m.name, tensor))
        return out

    def _copy_mapped(self, nbytes: int) -> torch.Tensor:
        """Receive a bucket's CUDA IPC handle, copy the bucket out of the sender's memory, let the
        mapping go, and acknowledge (the sender may reuse the memory from then on)."""
        g = self.group
        if self.ipc_device is None:
            raise MalformedStream(
                "weight transfer: a bucket came as a CUDA IPC handle, but this worker joined the group "
                "without a GPU to map it on"
            )
        length = torch.empty(1, dtype=torch.int64, device=g.device)
        g.broadcast(length)
        size = int(length.item())
        if not 0 < size <= cuda_ipc.MAX_HANDLE_BYTES:
            raise MalformedStream(
                f"weight transfer: a CUDA IPC handle of {size} bytes (at most {cuda_ipc.MAX_HANDLE_BYTES})"
            )
        blob = torch.empty(size, dtype=torch.uint8, device=g.device)
        g.broadcast(blob)
        error: Exception | None = None
        buffer = None
        try:
            mapped = cuda_ipc.open_bucket(blob.cpu().numpy().tobytes(), nbytes, self.ipc_device)
            buffer = _allocate((nbytes,), torch.uint8, self.ipc_device)
            buffer.copy_(mapped)
            torch.cuda.synchronize(self.ipc_device)  # the copy has read the sender's memory
            del mapped
        except (cuda_ipc.BadHandle, MalformedStream, RuntimeError) as err:
            error = err
        # acknowledged either way, so the sender learns of a failure instead of waiting it out
        g.gather(torch.tensor([int(error is not None)], dtype=torch.int64, device=g.device))
        if error is not None or buffer is None:
            raise MalformedStream(f"weight transfer: cannot map a CUDA IPC bucket: {one_line(error)}")
        return buffer

    def send_report(self, params_loaded: int, params_total: int, load_s: float) -> WorkerReport:
        report = WorkerReport(
            rank=self.group.rank,
            checksum=self.checksum.item(),
            tensors=self.tensors,
            bytes=self.bytes,
            buckets=self.buckets,
            params_loaded=params_loaded,
            params_total=params_total,
            receive_us=int(self.receive_s * 1e6),
            load_us=int(load_s * 1e6),
        )
        self.group.gather(report.to_tensor(self.group.device))
        return report


def _check_header(index: int, kind: int, payload_bytes: int, meta_bytes: int, n_tensors: int) -> None:
    if kind not in (KIND_FLAT, KIND_PER_TENSOR, KIND_IPC):
        raise MalformedStream(f"weight transfer: bucket {index} has unknown kind {kind}")
    if payload_bytes < 0 or n_tensors < 0 or not 0 <= meta_bytes <= MAX_METADATA_BYTES:
        raise MalformedStream(
            f"weight transfer: bucket {index} header announces {payload_bytes} payload bytes, "
            f"{meta_bytes} metadata bytes (at most {MAX_METADATA_BYTES}) and {n_tensors} tensors"
        )


def _parse_metadata(index: int, blob: bytes) -> list[TensorMeta]:
    """The bucket's ``[[name, dtype, shape], ...]`` list; ``MalformedStream`` naming what is wrong."""
    try:
        entries = json.loads(blob.decode("utf-8"))
    except ValueError as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise MalformedStream(f"weight transfer: bucket {index} metadata is not JSON ({err})") from None
    if not isinstance(entries, list):
        raise MalformedStream(f"weight transfer: bucket {index} metadata is not a list")
    metas = []
    for entry in entries:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and isinstance(entry[1], str)
            and isinstance(entry[2], list)
            and all(type(d) is int and d >= 0 for d in entry[2])
        ):
            raise MalformedStream(
                f"weight transfer: bucket {index} metadata entry {repr(entry)[:200]} is not "
                "[name, dtype, [non-negative dims]]"
            )
        try:
            dtype_from_name(entry[1])
        except ValueError as err:
            raise MalformedStream(f"weight transfer: bucket {index}: {err}") from None
        metas.append(TensorMeta(entry[0], entry[1], tuple(entry[2])))
    return metas


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    try:
        return torch.empty(shape, dtype=dtype, device=device)
    except RuntimeError as err:  # a size this device cannot hold: the stream announced garbage
        raise MalformedStream(
            f"weight transfer: cannot allocate a {dtype} tensor of shape {list(shape)}: {one_line(err)}"
        ) from None
