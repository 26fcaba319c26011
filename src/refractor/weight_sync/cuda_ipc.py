"""CUDA IPC handles of weight buckets, for a server that shares the trainer's GPU (colocated runs).

NCCL refuses two members of one communicator on one GPU, and going through host memory costs two
copies and a loopback socket per byte. Instead the trainer packs a bucket in its own GPU memory and
sends only a handle to it; the server maps that memory and copies the weights straight from it.

A handle travels as JSON (never pickled): the fields of ``UntypedStorage._share_cuda_()``, which
torch's own multiprocessing sends, with the byte strings in base64, plus where the bucket starts
in that storage and its length. The mapping process must not keep the mapping: it drops it once
its reads are done (synchronized), and only then tells the trainer, which may then reuse the memory.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import torch

# a handle is about 300 bytes of JSON; anything much longer is not one
MAX_HANDLE_BYTES = 4096


class BadHandle(ValueError):
    """A bucket handle that is not one this module wrote (the message names the field)."""


def export_bucket(payload: torch.Tensor) -> bytes:
    """The handle of ``payload`` (a contiguous uint8 CUDA tensor) as JSON bytes. The caller keeps
    ``payload`` alive and unchanged until every process that mapped it is done with it."""
    if payload.device.type != "cuda" or payload.dtype != torch.uint8 or not payload.is_contiguous():
        raise ValueError(
            f"a CUDA IPC bucket is a contiguous uint8 CUDA tensor, got {payload.dtype} on {payload.device}"
        )
    (
        device,
        handle,
        storage_bytes,
        storage_offset,
        counter_handle,
        counter_offset,
        event_handle,
        event_sync,
    ) = payload.untyped_storage()._share_cuda_()
    fields = {
        "device": int(device),
        "handle": _b64(handle),
        "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset),
        "counter_handle": _b64(counter_handle),
        "counter_offset": int(counter_offset),
        "event_handle": None if event_handle is None else _b64(event_handle),
        "event_sync": bool(event_sync),
        "offset": payload.storage_offset(),
        "nbytes": payload.numel(),
    }
    return json.dumps(fields, separators=(",", ":")).encode()


def open_bucket(blob: bytes, nbytes: int, device: torch.device) -> torch.Tensor:
    """Map the bucket a handle names: a uint8 tensor of ``nbytes`` on ``device`` (this process's
    index of the GPU the handle's memory is on). ``BadHandle`` if the blob is not a handle.
    The mapping waits for the trainer's writes to the bucket (the handle's event)."""
    fields = _parse(blob)
    if fields["nbytes"] != nbytes or fields["offset"] + nbytes > fields["storage_bytes"]:
        raise BadHandle(
            f"the handle covers bytes {fields['offset']}..{fields['offset'] + fields['nbytes']} of a "
            f"{fields['storage_bytes']}-byte allocation, the bucket is {nbytes} bytes"
        )
    with torch.cuda.device(device):
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index if device.index is not None else torch.cuda.current_device(),
            fields["handle"],
            fields["storage_bytes"],
            fields["storage_offset"],
            fields["counter_handle"],
            fields["counter_offset"],
            fields["event_handle"],
            fields["event_sync"],
        )
    out = torch.empty(0, dtype=torch.uint8, device=device)
    out.set_(storage, fields["offset"], (nbytes,))
    return out


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


_INTS = ("device", "storage_bytes", "storage_offset", "counter_offset", "offset", "nbytes")
_STRINGS = ("handle", "counter_handle")


def _parse(blob: bytes) -> dict[str, Any]:
    if len(blob) > MAX_HANDLE_BYTES:
        raise BadHandle(f"a bucket handle is at most {MAX_HANDLE_BYTES} bytes, got {len(blob)}")
    try:
        fields = json.loads(blob.decode("utf-8"))
    except ValueError as err:
        raise BadHandle(f"a bucket handle is JSON: {err}") from None
    if not isinstance(fields, dict):
        raise BadHandle("a bucket handle is a JSON object")
    for name in _INTS:
        if type(fields.get(name)) is not int or fields[name] < 0:
            raise BadHandle(f"bucket handle field {name!r} must be a non-negative integer")
    if not isinstance(fields.get("event_sync"), bool):
        raise BadHandle("bucket handle field 'event_sync' must be true or false")
    for name in (*_STRINGS, "event_handle"):
        value = fields.get(name)
        if value is None and name == "event_handle":
            continue
        try:
            fields[name] = base64.b64decode(value, validate=True)
        except (TypeError, ValueError):  # binascii.Error is a ValueError
            raise BadHandle(f"bucket handle field {name!r} must be a base64 string") from None
    return fields
