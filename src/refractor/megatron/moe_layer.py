"""Megatron-Core's MoE layer on any device and process group backend (needs the ``megatron`` extra).

Megatron-Core 0.16's MoE pieces assume CUDA where refractor's trainer runs on CPU (gloo) too:

* ``Router.gating`` moves a CPU router weight to ``torch.cuda.current_device()`` on every call, and
  its GEMM (``router_gating_linear``) names a Transformer Engine function that is undefined without
  Transformer Engine; ``Router`` computes the same float32 logits with torch, where the weight is.
* the ``alltoall`` dispatcher creates a CUDA stream when built, and the ``allgather`` dispatcher's
  collectives allocate their outputs on the current CUDA device; and both gather equal token counts,
  where refractor's expert-parallel ranks (data-parallel replicas) hold rows of different lengths.
  ``EveryDeviceDispatcher`` (each MoE layer's, ``use_every_device_dispatchers``) is the ``allgather``
  dispatcher whose two collectives are refractor's (``sequence_parallel.py``) over the TP x EP
  ranks (Megatron-Core's ``tp_ep`` group): every rank pads its tokens to the longest rank's count,
  the ranks all-gather tokens, probabilities and routing map, each rank's experts (its TP shard of
  them) compute the tokens routed to them, and a reduce-scatter sums the experts' outputs (and the
  TP shards' partial sums) back to the ranks that hold the tokens (its backward all-gathers the
  gradient, the gather's backward reduce-scatters it). Padding tokens are routed to no expert.
* Under TP the MoE layer takes each TP rank's block of the sequence, which refractor's sequence
  parallelism gives it (``megatron_sequence_parallel``); Megatron-Core's MoE layer refuses to train
  under TP unless its ``TransformerConfig`` says ``sequence_parallel``, which the rest of the model
  must not see (its own sequence-parallel path is CUDA-only): each MoE layer gets a copy of the
  config that says it.

The experts are Megatron-Core's ``SequentialMLP`` (one gated MLP per local expert).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from refractor.megatron.sequence_parallel import gather_sequence, reduce_scatter_sequence


class Router(TopKRouter):
    """Megatron-Core's top-k router with its gating GEMM where its weight is, in float32."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.linear(input.float(), self.weight.float(), bias)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return F.pad(x, (0, 0, 0, rows - x.shape[0]))


class EveryDeviceDispatcher(MoEAllGatherTokenDispatcher):
    """The all-gather dispatcher over the TP x EP ranks with token counts that differ among the ranks
    (module docstring)."""

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.tp_size == 1 and self.ep_size == 1:
            return hidden_states, probs
        group = self.tp_ep_group
        self.local_tokens = hidden_states.shape[0]
        most = torch.tensor(self.local_tokens, device=hidden_states.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        rows = int(most)
        with torch.no_grad():
            routing = _pad_rows(self.routing_map.to(torch.uint8), rows)
            self.routing_map = gather_sequence(routing, group).bool()
        probs = gather_sequence(_pad_rows(probs, rows), group)
        hidden_states = gather_sequence(_pad_rows(hidden_states, rows), group)
        return hidden_states, probs

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 and self.ep_size == 1:
            return hidden_states
        # summed in the probabilities' dtype (float32), as Megatron-Core's dispatcher sums
        summed = reduce_scatter_sequence(hidden_states.to(self.local_probs.dtype), self.tp_ep_group)
        return summed[: self.local_tokens].to(hidden_states.dtype)


def use_every_device_dispatchers(model: torch.nn.Module, groups, sequence_parallel: bool) -> None:
    """Give each of ``model``'s MoE layers an ``EveryDeviceDispatcher`` over the process groups
    ``groups`` (a ``ProcessGroupCollection``: the layers' own), in place of the dispatcher its
    ``TransformerConfig`` names; with ``sequence_parallel`` (refractor's, under TP) a config that says
    so (module docstring)."""
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            if sequence_parallel:
                layer.config = copy.copy(layer.config)
                layer.config.sequence_parallel = True
            layer.token_dispatcher = EveryDeviceDispatcher(
                layer.num_local_experts, layer.local_expert_indices, config=layer.config, pg_collection=groups
            )
