"""Full (unsharded) weights, bucket by bucket, for the weight sync to inference servers.

Buckets are planned from shapes alone (the same on every rank): consecutive parameters in
``named_parameters`` order, closed before a bucket would exceed ``bucket_bytes`` in the target
dtype (a larger tensor forms a bucket of its own). Per bucket, each rank casts its local FSDP
shards into ONE flat buffer (one ``_foreach_copy_``), the buffers are all-gathered in ONE
collective, and rank 0 cuts the full tensors out of the result; the other ranks drop it at once
and yield empty lists. No rank holds more than about two buckets of full weights (the gathered
buffer while its tensors are cut out), and the gather moves the target dtype (half the bytes of
fp32 master weights for bf16 inference). On one rank there is no collective: the shards are the
full tensors, cast into the bucket's buffer, and yielded as views of it.

Names are HF names; a tied LM head appears once, as ``model.embed_tokens.weight`` (as in
``named_parameters``; inference engines alias ``lm_head.weight`` to it). LoRA adapters are merged:
a projection with an adapter is exported as ``W + scale * B A`` (its local rows from the local rows
of ``B`` and the whole of ``A``, which is small), and the adapter tensors themselves are not sent.
With ``adapters=True`` it is the other way round (``lora_sync: adapter``): only what trains, the
adapter tensors and the weights of ``lora_modules_to_save`` (trained in full), gathered and bucketed
the same way, then one last bucket holding the scale (``ADAPTER_SCALE_NAME``, float32) for the engine
that applies the adapters at run time over the base it loaded itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from refractor.models.lora import ADAPTER_SCALE_NAME, LoRALinear, is_adapter_name, lora_modules
from refractor.trainer.policy_model import hf_name

WeightBucket = list[tuple[str, torch.Tensor]]


def tensor_nbytes(t: torch.Tensor, dtype: torch.dtype) -> int:
    return t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())


@dataclass(frozen=True)
class _Slot:
    """One parameter inside a bucket's per-rank buffer (FSDP2 shards dim 0 like ``torch.chunk``)."""

    name: str
    param: torch.Tensor
    shape: torch.Size
    rows_per_rank: int  # ceil(dim0 / world): every rank's part is padded to this many rows
    offset: int  # element offset in the per-rank buffer
    adapter: LoRALinear | None = None  # the projection's LoRA adapter, merged into ``param``

    def local(self) -> torch.Tensor:
        """This rank's rows of the exported tensor."""
        if self.adapter is None:
            return _local(self.param)
        a, b = self.adapter.lora_A.weight, self.adapter.lora_B.weight
        a_full = (a.full_tensor() if isinstance(a, DTensor) else a).detach()  # collective: slot order
        return self.adapter.merged_weight(_local(self.param), a_full, _local(b))

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def padded_numel(self) -> int:
        return self.rows_per_rank * self.row_numel


def _plan(
    model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None, world: int, adapters_only: bool
) -> Iterator[tuple[torch.dtype, list[_Slot]]]:
    """Buckets of slots, each with one dtype (a dtype change closes the bucket): the merged weights,
    or with ``adapters_only`` the trained tensors alone (the adapters and any module trained in full)."""
    slots: list[_Slot] = []
    size = 0
    offset = 0
    current = None
    adapters = {} if adapters_only else {id(module.weight): module for _, module in lora_modules(model)}
    for name, param in model.named_parameters():
        adapter = is_adapter_name(name)
        sent = (adapter or param.requires_grad) if adapters_only else not adapter
        if not sent:
            continue
        target = dtype if (dtype is not None and param.is_floating_point()) else param.dtype
        nbytes = tensor_nbytes(param, target)
        if slots and (size + nbytes > bucket_bytes or target != current):
            yield current, slots
            slots = []
            size = 0
            offset = 0
        shape = param.shape  # a DTensor reports the full (global) shape
        rows = -(-shape[0] // world) if len(shape) else 1
        slot = _Slot(hf_name(name), param, shape, rows, offset, adapters.get(id(param)))
        slots.append(slot)
        size += nbytes
        offset += slot.padded_numel
        current = target
    if slots:
        yield current, slots


def _local(param: torch.Tensor) -> torch.Tensor:
    return (param.to_local() if isinstance(param, DTensor) else param).detach()


@torch.no_grad()
def iter_weight_buckets(
    model: nn.Module,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    adapters: bool = False,
) -> Iterator[WeightBucket]:
    """Yield ``[(hf_name, full_tensor)]`` buckets; call on every rank, consume on rank 0.

    Tensors live on ``device`` (default: where the parameters are; the training device when they
    are offloaded to host memory, so the gather runs on its backend); floating tensors are cast to
    ``dtype``. Every rank yields the same number of buckets. The tensors of a bucket share one
    buffer: keep a bucket only as long as it is needed (the next one is gathered when the iterator
    advances). ``adapters``: the LoRA adapters, the modules trained in full and the adapters' scale
    instead of the weights (module doc).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    sharded = world > 1 and any(
        isinstance(p, DTensor) and p.device_mesh.size() > 1 for p in model.parameters()
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    scales = {module.scale for _, module in lora_modules(model)}
    if adapters and len(scales) != 1:
        raise ValueError("an adapter export needs a model with LoRA adapters of one scale (lora_rank > 0)")
    yield from _gathered(model, bucket_bytes, dtype, device, adapters, world if sharded else 1, rank)
    if adapters:
        scale = torch.tensor([scales.pop()], dtype=torch.float32, device=device)
        yield [(ADAPTER_SCALE_NAME, scale)] if rank == 0 else []


def _gathered(
    model: nn.Module,
    bucket_bytes: int,
    dtype: torch.dtype | None,
    device: torch.device | None,
    adapters: bool,
    world: int,
    rank: int,
) -> Iterator[WeightBucket]:
    """The buckets of ``_plan``, gathered over ``world`` ranks (1: the local tensors are whole)."""
    sharded = world > 1
    for target, slots in _plan(model, bucket_bytes, dtype, world, adapters):
        where = device or _local(slots[0].param).device
        local = torch.zeros(sum(s.padded_numel for s in slots), dtype=target, device=where)
        shards = [s.local().reshape(-1) for s in slots]
        views = [local[s.offset : s.offset + shard.numel()] for s, shard in zip(slots, shards, strict=True)]
        torch._foreach_copy_(views, shards)  # cast + copy of every shard, a few kernels in all
        del views, shards
        if not sharded:  # one rank: the buffer holds the full tensors
            yield [(s.name, local[s.offset : s.offset + s.padded_numel].view(s.shape)) for s in slots]
            del local
            continue
        gathered = _all_gather(local, world)  # [world, numel]
        del local
        if rank != 0:
            del gathered
            yield []
            continue
        bucket = [(s.name, _full_tensor(gathered, s)) for s in slots]
        del gathered
        yield bucket
        del bucket


def _all_gather(local: torch.Tensor, world: int) -> torch.Tensor:
    out = torch.empty((world, local.numel()), dtype=local.dtype, device=local.device)
    if dist.get_backend() == "gloo":  # gloo has no all_gather_into_tensor
        dist.all_gather(list(out.unbind(0)), local)
    else:
        dist.all_gather_into_tensor(out, local)
    return out


def _full_tensor(gathered: torch.Tensor, slot: _Slot) -> torch.Tensor:
    """Rank-major padded parts -> the full tensor (rows beyond dim 0 are padding)."""
    parts = gathered[:, slot.offset : slot.offset + slot.padded_numel]
    if not slot.shape:
        return parts[0, 0].clone()
    rows = parts.reshape(-1, *slot.shape[1:])[: slot.shape[0]]
    return rows.contiguous()
