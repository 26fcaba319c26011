"""Grouping (name, tensor) pairs into dtype-homogeneous buckets of bounded size.

One rule for both the planning form (metadata only, no data) and the streaming form: tensors
keep their order within a dtype, a bucket never exceeds ``bucket_bytes`` unless a single tensor
is larger (it then travels alone), and every tensor lands in exactly one bucket. Streaming keeps
at most one open bucket per dtype, so memory stays bounded by a bucket per dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in weight-transfer metadata")
    return dtype


def _bucketize(
    items: Iterable[T], bucket_bytes: int, key: Callable[[T], tuple[str, int]]
) -> Iterator[list[T]]:
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    open_buckets: dict[str, tuple[list[T], int]] = {}
    for item in items:
        dtype, nbytes = key(item)
        bucket, size = open_buckets.get(dtype, ([], 0))
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket = []
            size = 0
        bucket.append(item)
        open_buckets[dtype] = (bucket, size + nbytes)
    for bucket, _ in open_buckets.values():
        if bucket:
            yield bucket


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """The buckets ``iter_buckets`` would form for tensors with these metadata."""
    return list(_bucketize(metas, bucket_bytes, lambda m: (m.dtype, m.nbytes)))


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Stream (name, tensor) pairs as dtype-homogeneous buckets of at most ``bucket_bytes``."""
    return _bucketize(
        named_tensors,
        bucket_bytes,
        lambda nt: (dtype_name(nt[1].dtype), nt[1].numel() * nt[1].element_size()),
    )


def split_by_dtype(bucket: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """Make a caller's bucket dtype-homogeneous (stable order within each dtype)."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in bucket:
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    return list(by_dtype.values())
