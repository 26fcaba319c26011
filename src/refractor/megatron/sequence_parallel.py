"""Sequence parallelism (``megatron_sequence_parallel: true``): with TP > 1, the activations outside
attention and the MLP are split along the sequence among the tensor-parallel ranks.

Without it every TP rank holds a pass's whole hidden states [T, 1, H] between the layers' parallel
GEMMs: the norms, the residual adds and the activations kept for the backward are computed and
stored TP times over. With it rank r holds the tokens ``[r * T / TP, (r + 1) * T / TP)`` of them:

* the embedding's output (the same on every TP rank) is split (``scatter_sequence``); its backward
  gathers the gradient;
* a column-parallel linear (the fused QKV, the gate/up projection) gathers the sequence before its
  GEMM (``sequence_linears.SequenceColumnLinear``): its backward reduce-scatters the input gradient,
  the sum over the ranks' heads / columns that the all-reduce computes without sequence parallelism;
* a row-parallel linear (the attention's output projection, the down projection) reduce-scatters its
  partial sums (``sequence_linears.SequenceRowLinear``) where the all-reduce would sum them whole;
* the final norm's output is gathered before the vocabulary-parallel head (``gather_sequence``),
  whose backward reduce-scatters the ranks' partial gradients.

The communication volume equals the all-reduces' (an all-reduce is a reduce-scatter and an
all-gather); what is saved is activation memory and the norm / residual work, divided by TP.
Attention runs on the whole sequence (after the QKV gather), so the row's rotary table and its
``PackedAttention`` are those of the whole pass. A pass is padded to a multiple of TP tokens
(the trainer's ``pass_pad_multiple``; the padding is masked out of the loss).

The norms' weights are replicated over the TP ranks and each rank's gradient covers its tokens only:
their gradients are summed over the TP group before the norm and the update
(``SEQUENCE_SUMMED``; Megatron-Core marks them ``sequence_parallel`` and its DDP sums them).

Megatron-Core's own sequence-parallel path (``TransformerConfig.sequence_parallel``) allocates its
buffers with ``torch.cuda.current_device()`` and its local layer spec's torch norms refuse it; these
linears are Megatron-Core's, whose GEMM runs without communication (``disable_grad_reduce``), with
the collectives above around it, on any device and process group backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# the parameters replicated over TP that see one sequence shard per rank, their gradients summed: the
# norms, the row-parallel linears' biases (added after the reduce-scatter) when a model has them, and
# an MoE layer's router (each rank routes its own tokens)
SEQUENCE_SUMMED = (
    "input_layernorm.weight",
    "pre_mlp_layernorm.weight",
    "final_layernorm.weight",
    "linear_proj.bias",
    "linear_fc2.bias",
    "mlp.router.weight",
)


# torch's one-tensor all-gather and reduce-scatter, under their current names where torch has them
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[n, ...] on each rank -> [n * ranks, ...], rank order."""
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    _ALL_GATHER(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[n * ranks, ...] on each rank -> this rank's [n, ...] block of the sum over the ranks."""
    ranks = dist.get_world_size(group)
    if x.shape[0] % ranks:
        raise ValueError(f"sequence parallelism: {x.shape[0]} tokens do not split over {ranks} ranks")
    out = x.new_empty((x.shape[0] // ranks, *x.shape[1:]))
    _REDUCE_SCATTER(out, x.contiguous(), group=group)
    return out


def _own_block(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    ranks = dist.get_world_size(group)
    if x.shape[0] % ranks:
        raise ValueError(
            f"sequence parallelism: a pass of {x.shape[0]} tokens does not split over {ranks} "
            "tensor-parallel ranks (passes are padded to a multiple of TP)"
        )
    size = x.shape[0] // ranks
    return x.narrow(0, dist.get_rank(group) * size, size).contiguous()


class _Scatter(torch.autograd.Function):
    """Forward: this rank's block of the sequence; backward: the blocks' gradients gathered."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_block(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group), None


class _Gather(torch.autograd.Function):
    """Forward: the whole sequence; backward: the ranks' gradients summed, this rank's block kept."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    """Forward: the partial sums summed, this rank's block kept; backward: the gradient gathered."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group), None


def scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Scatter.apply(x, group)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Gather.apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceScatter.apply(x, group)
