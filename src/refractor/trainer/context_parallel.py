"""Context parallelism: the ranks of a context-parallel (CP) group share every packed row.

``fsdp_context_parallel_size = cp`` arranges the trainer ranks as ``dp x cp`` (rank = dp_index * cp
+ cp_index). The ``cp`` ranks of a group receive the same rows; each runs the decoder on 1/cp of a
row's tokens, so a row's activations are spread over the group and rows longer than one GPU holds
can train. FSDP2 still shards parameters over all ranks and sums gradients over all of them.

How a pass runs (``PolicyModel.forward`` with a ``ContextGroup``):

* **Tokens.** The row (padded to a multiple of 2 x cp) is cut into 2 x cp equal chunks; CP rank c
  takes chunks c and 2cp-1-c ("zig-zag"), so every rank gets an early and a late part and the causal
  attention work is balanced when samples are long.
* **Attention.** Every layer all-gathers the keys and values of the whole row across the group
  (grouped-query attention keeps them small) and attends the rank's queries to them with the
  row's block-causal document mask in global positions: causal inside a sample, nothing across
  samples, exactly as without CP. The all-gather's backward reduce-scatters the key/value
  gradients, so each rank's projections get the gradients of every rank's queries.
* **Log-probs.** Each rank computes the log-prob of the token after each of its own tokens (all
  ranks hold the row's token ids), so no label is lost at a chunk boundary. The per-token values
  are gathered into the whole row on every rank; the loss is computed on the whole row, identically
  on every rank, and the gather's backward keeps each rank's own slice of the gradient (summed over
  the group by FSDP's reduction, that is the gradient of the loss once).
* **Statistics.** Only CP rank 0 counts a row's loss statistics (every rank computed the same).

Exactness: the loss and gradients equal those of ``cp = 1`` up to summation order (tested with
gloo on CPU, ``tests/trainer/test_context_parallel.py``).

The Megatron trainer's context parallelism (``megatron_context_parallel_size``) runs the same split,
attention and log-prob gather inside Megatron-Core's model (``refractor/megatron/forward.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from refractor.models.attention import (
    masked_attention,
    varlen_attention_available,
    varlen_causal_attention,
)


def shard_positions(length: int, size: int, rank: int) -> torch.Tensor:
    """Positions (ascending) of a ``length``-token row that CP rank ``rank`` of ``size`` holds:
    chunks ``rank`` and ``2 * size - 1 - rank`` of ``2 * size``."""
    if length % (2 * size):
        raise ValueError(f"a context-parallel pass needs a multiple of {2 * size} tokens, got {length}")
    chunk = length // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    last = (2 * size - 1 - rank) * chunk
    return torch.cat([first, torch.arange(last, last + chunk)])


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place in its CP group (``group`` None: a group of one, nothing is split)."""

    size: int
    rank: int
    group: Any = None  # torch.distributed ProcessGroup of the ``size`` ranks sharing rows

    @classmethod
    def create(cls, size: int, device: torch.device) -> ContextGroup:
        """Collective (every rank calls it): the groups of consecutive ranks of a ``dp x size`` mesh."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if size < 1 or world % size:
            raise ValueError(
                f"fsdp_context_parallel_size ({size}) must divide the number of trainer ranks ({world})"
            )
        if size == 1:
            return cls(1, 0)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world // size, size), mesh_dim_names=("dp", "cp"))
        return cls(size, rank % size, mesh.get_group("cp"))

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def is_lead(self) -> bool:
        """The rank that counts a shared row's statistics."""
        return self.rank == 0

    def shard(self, document_ids: torch.Tensor) -> RowShard:
        """This rank's part of one pass (``document_ids``: the whole row's [T] ids, on the device)."""
        length = int(document_ids.numel())
        device = document_ids.device
        held = [shard_positions(length, self.size, r) for r in range(self.size)]
        order = torch.argsort(torch.cat(held))  # whole row = gathered[order]
        return RowShard(self, document_ids, held[self.rank].to(device), order.to(device))


@dataclass
class RowShard:
    """One pass split over a CP group: what this rank holds and how to put the row back together."""

    context: ContextGroup
    document_ids: torch.Tensor  # [T] the whole row's sample ids (-1: padding)
    positions: torch.Tensor  # [T / cp] positions of this rank's tokens in the row, ascending
    order: torch.Tensor  # [T] index into the rank-major gathered tokens giving row order

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a whole-row [T, ...] tensor."""
        return x[self.positions]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[T / cp, ...] of every rank -> the whole row [T, ...], differentiable: the backward sums
        each rank's gradient for a token and hands it to the rank holding it (reduce-scatter)."""
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        gathered = all_gather_tensor_autograd(x.contiguous(), 0, self.context.group)
        return gathered[self.order]

    def gather_shared(self, x: torch.Tensor) -> torch.Tensor:
        """As ``gather``, for values every rank then uses identically (the loss): the backward keeps
        this rank's own slice of the gradient, with no communication."""
        return _GatherShared.apply(x, self)

    def attention(self) -> ContextParallelAttention:
        return ContextParallelAttention(self)

    def next_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token after each of this rank's tokens (the row's last token: itself, a label that
        ``token_values`` drops), so that a rank predicts across its chunks' boundaries."""
        return input_ids[(self.positions + 1).clamp(max=input_ids.numel() - 1)]

    def token_values(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's per-token values about ``next_tokens`` [T / cp] -> the whole row's [T], aligned
        with the tokens they are about (position 0 holds 0.0: it predicts nothing) as one rank's
        ``token_logprobs_and_entropy`` aligns them; the backward keeps this rank's own values'
        gradients (``gather_shared``)."""
        return torch.cat([values.new_zeros(1), self.gather_shared(values)[:-1]])


class _GatherShared(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: RowShard) -> torch.Tensor:
        ctx.positions = shard.positions
        parts = [torch.empty_like(x) for _ in range(shard.context.size)]
        dist.all_gather(parts, x.contiguous(), group=shard.context.group)
        return torch.cat(parts)[shard.order]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[ctx.positions], None


class ContextParallelAttention:
    """The decoder's attention backend on a CP rank: this rank's queries against the whole row's
    keys and values (gathered per layer), block-causal in the row's global positions.

    On CUDA in bf16/fp16, torch's varlen FlashAttention runs on segments: each run of this rank's
    queries from one sample attends to that sample's keys from its start up to the run's last token
    (bottom-right causal alignment puts each query on its own position). Elsewhere SDPA takes an
    explicit [T / cp, T] mask (the same rule; padding attends only to itself).
    """

    def __init__(self, shard: RowShard) -> None:
        self.shard = shard
        self._mask: torch.Tensor | None = None
        self._varlen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if shard.document_ids.is_cuda and varlen_attention_available():
            # Here, eagerly, not at the first attention call inside the compiled layers: Dynamo would
            # unroll query_segments' Python loop over the row, a trace that grows with the row's length.
            index, cu_q, cu_k, _, _ = query_segments(shard.document_ids, shard.positions)
            self._varlen = (index, cu_q, cu_k)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int) -> torch.Tensor:
        kv = self.shard.gather(torch.cat([k, v], dim=1))  # one collective for both
        k_row, v_row = kv.split([k.shape[1], v.shape[1]], dim=1)
        return self.attend(q, k_row, v_row)

    def attend(self, q: torch.Tensor, k_row: torch.Tensor, v_row: torch.Tensor) -> torch.Tensor:
        """This rank's queries [T / cp, H, D] against the whole row's keys and values [T, H_kv, D]."""
        if self._varlen is not None and q.dtype in (torch.bfloat16, torch.float16):
            index, cu_q, cu_k = self._varlen
            # the kernel takes the longest segments' lengths as launch bounds; the shard's and the row's
            # lengths bound them and stay the same for every row of a pass length, so the compiled
            # layers see the same integers (no recompile per row)
            return varlen_causal_attention(
                q, k_row[index], v_row[index], cu_q, q.shape[0], cu_k, k_row.shape[0]
            )
        if self._mask is None:
            self._mask = row_mask(self.shard.document_ids, self.shard.positions)
        return masked_attention(q, k_row, v_row, self._mask)


def row_mask(document_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[T] row ids, [Tq] query positions -> [Tq, T] bool: query at position p may see key s when
    both are in the same sample and s <= p; padding (-1) sees only itself."""
    keys = torch.arange(document_ids.numel(), device=document_ids.device)
    query_docs = document_ids[positions]
    same = (query_docs[:, None] == document_ids[None, :]) & (keys[None, :] <= positions[:, None])
    own = keys[None, :] == positions[:, None]
    pad = query_docs < 0
    return (same & ~pad[:, None]) | (own & pad[:, None])


@torch.compiler.disable  # a Python loop over the row: never traced (see ContextParallelAttention)
def query_segments(
    document_ids: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Varlen layout of this rank's queries: (key index into the row, cu_seqlens of the queries, of
    the keys, their max lengths). A segment is a run of consecutive query positions in one span of
    equal ids (a sample, or the padding); its keys run from the span's start to the segment's end.
    """
    docs = document_ids.tolist()
    starts = [0] * len(docs)  # start of the span of equal ids each position is in
    for i in range(1, len(docs)):
        starts[i] = starts[i - 1] if docs[i] == docs[i - 1] else i
    pos = positions.tolist()
    index: list[int] = []
    cu_q, cu_k = [0], [0]
    begin = 0
    for j in range(1, len(pos) + 1):
        if j < len(pos) and pos[j] == pos[j - 1] + 1 and starts[pos[j]] == starts[pos[j - 1]]:
            continue
        end = pos[j - 1] + 1  # the segment is pos[begin:j]
        span_start = starts[pos[begin]]
        index.extend(range(span_start, end))
        cu_q.append(j)
        cu_k.append(len(index))
        begin = j
    device = document_ids.device
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:], strict=False))
    max_k = max(b - a for a, b in zip(cu_k, cu_k[1:], strict=False))
    return (
        torch.tensor(index, device=device),
        torch.tensor(cu_q, dtype=torch.int32, device=device),
        torch.tensor(cu_k, dtype=torch.int32, device=device),
        max_q,
        max_k,
    )
