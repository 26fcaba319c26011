"""A rank's Megatron-Core weights from HF tensors, and its stage's weights back as whole HF tensors.

``WeightPlan`` lays out, from the HF config alone (the same on every rank), what each pipeline stage
holds: every parameter's name in the stage's ``GPTModel``, its name in the whole model, the shape of
each tensor-parallel rank's shard and the HF tensors it becomes. Planning runs the mapping
(``mapping``, ``shards``) on meta tensors, so it costs no memory.

* Loading: a rank reads only the HF tensors its stage needs (``needed_hf_names``), and the mapping
  makes its shard (``stage_state``); the other stages' tensors stay meta.
* Gathering (weight export, checkpoints): per bucket of one stage's parameters, the stage's
  tensor-parallel ranks all-gather their shards in one flat buffer, and the stage's first TP rank
  merges them (``merge_tensor``) into whole HF tensors. A tied head's copy on the last stage is left
  out (the first stage's embedding is the tensor).
* Experts (expert parallelism): the plan lists the experts of EP rank 0 (numbered from 0, as every EP
  rank's model numbers its own); EP rank ``r``'s are the same tensors of experts ``r E/p`` on. A
  bucket holds either experts or other tensors: an expert bucket is gathered by the EP ranks of the
  first expert replica, whose first TP ranks all-gather their merged tensors (EP rank order).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from refractor.megatron.experts import dense_view, model_config
from refractor.megatron.mapping import (
    hf_expert_shapes,
    hf_to_megatron,
    megatron_param_to_hf,
    renumber_hf_expert,
)
from refractor.megatron.parallel import MegatronRanks
from refractor.megatron.shards import (
    EMBEDDING,
    FINAL_NORM,
    OUTPUT,
    MegatronLayout,
    expert_state,
    experts_per_rank,
    global_name,
    hf_to_shards,
    is_expert,
    merge_tensor,
    to_shards,
)
from refractor.models import ModelConfig

WeightBucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class PlannedTensor:
    local: str  # name in the stage's GPTModel
    source: str  # the whole-model Megatron tensor it is a shard of
    shard_shape: torch.Size  # every tensor-parallel rank's shard
    hf: tuple[tuple[str, torch.Size], ...]  # the HF tensors it becomes
    duplicate: bool = False  # a tied head's copy of the embedding on the last stage
    expert: bool = False  # an expert's (EP rank 0's expert; each EP rank holds its own)

    @property
    def shard_numel(self) -> int:
        return self.shard_shape.numel()


def _order(name: str) -> tuple:
    """A stage's parameters in the model's order: embedding, layers, final norm, head; the experts of
    the layers after them (expert buckets are gathered apart)."""
    if name == EMBEDDING:
        return (0,)
    if name == FINAL_NORM:
        return (2,)
    if name == OUTPUT:
        return (3,)
    layer, rest = name.removeprefix("decoder.layers.").split(".", 1)
    return (4 if is_expert(name) else 1, int(layer), rest)


def hf_skeleton(hf_config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every HF tensor of the model as a meta tensor (names and shapes, no memory): refractor's model
    of the architecture (an MoE model's dense counterpart, its MLPs replaced by the router and
    experts)."""
    from refractor.models import build_model

    raw = dict(hf_config)
    with torch.device("meta"):
        skeleton = dict(build_model(dense_view(raw)).state_dict())
    config = model_config(raw)
    if config.moe is None:
        return skeleton
    skeleton = {name: t for name, t in skeleton.items() if ".mlp." not in name}
    return {**skeleton, **{n: torch.empty(s, device="meta") for n, s in hf_expert_shapes(config).items()}}


@dataclass(frozen=True)
class WeightPlan:
    config: ModelConfig
    layout: MegatronLayout
    skeleton: dict[str, torch.Tensor]  # HF name -> meta tensor
    stages: tuple[tuple[PlannedTensor, ...], ...]

    @classmethod
    def build(cls, hf_config: Mapping[str, Any], layout: MegatronLayout) -> WeightPlan:
        config = model_config(dict(hf_config))
        skeleton = hf_skeleton(hf_config)
        whole = hf_to_megatron(skeleton, config, transformer_engine=layout.transformer_engine)
        stages = []
        for stage, ranks in enumerate(to_shards(expert_state(whole, config, layout, 0), config, layout)):
            first_layer = layout.stage_layers(config, stage).start
            planned = []
            for local in sorted(ranks[0], key=_order):
                duplicate = local == OUTPUT and config.tie_word_embeddings
                source = EMBEDDING if duplicate else global_name(local, first_layer)
                hf = megatron_param_to_hf(
                    source, whole[source], config, transformer_engine=layout.transformer_engine
                )
                shapes = tuple((n, t.shape) for n, t in hf)
                shard = ranks[0][local].shape
                planned.append(PlannedTensor(local, source, shard, shapes, duplicate, is_expert(local)))
            stages.append(tuple(planned))
        return cls(config, layout, skeleton, tuple(stages))

    def hf_of(self, tensor: PlannedTensor, expert_rank: int) -> list[tuple[str, torch.Size]]:
        """The HF tensors that ``tensor`` becomes on EP rank ``expert_rank``."""
        if not tensor.expert:
            return list(tensor.hf)
        offset = expert_rank * experts_per_rank(self.config, self.layout)
        return [(renumber_hf_expert(name, offset), shape) for name, shape in tensor.hf]

    def hf_shapes(self, tensors: list[PlannedTensor]) -> list[tuple[str, torch.Size]]:
        """The HF tensors of a bucket in ``gather_bucket``'s order: an expert bucket's for each EP rank."""
        ranks = range(self.layout.expert_parallel if tensors[0].expert else 1)
        return [shape for rank in ranks for t in tensors for shape in self.hf_of(t, rank)]

    def gathered_by(self, ranks: MegatronRanks, tensors: list[PlannedTensor]) -> bool:
        """Whether this rank takes part in gathering a bucket of its stage: the first replica's first CP
        rank's ranks, for experts the first expert replica's (every EP rank of the first replica's
        group)."""
        return ranks.expert_data_rank == 0 if tensors[0].expert else ranks.is_first_replica

    def needed_hf_names(self, stage: int, expert_rank: int = 0) -> list[str]:
        """The HF tensors the stage's shards on EP rank ``expert_rank`` are made of."""
        return [name for planned in self.stages[stage] for name, _ in self.hf_of(planned, expert_rank)]

    def stage_state(
        self, hf_tensors: Mapping[str, torch.Tensor], stage: int, tensor_rank: int, expert_rank: int = 0
    ) -> dict[str, torch.Tensor]:
        """The state dict of the stage's GPTModel on ``tensor_rank`` of EP rank ``expert_rank`` from (at
        least) its HF tensors."""
        needed = self.needed_hf_names(stage, expert_rank)
        missing = sorted(set(needed) - hf_tensors.keys())
        if missing:
            raise KeyError(f"the HF weights lack {', '.join(f'`{n}`' for n in missing[:4])}")
        whole = {**self.skeleton, **{n: hf_tensors[n] for n in needed}}
        return hf_to_shards(whole, self.config, self.layout, expert_rank)[stage][tensor_rank]

    def buckets(self, bucket_bytes: int, dtype: torch.dtype) -> list[tuple[int, list[PlannedTensor]]]:
        """(stage, tensors) buckets of at most ``bucket_bytes`` HF bytes in ``dtype`` (a larger tensor
        is a bucket of its own; an expert's counts once per EP rank); a bucket holds one stage's
        tensors, in the model's order, experts or other tensors."""
        out: list[tuple[int, list[PlannedTensor]]] = []
        for stage, planned in enumerate(self.stages):
            current: list[PlannedTensor] = []
            size = 0
            for tensor in planned:
                if tensor.duplicate:
                    continue
                copies = self.layout.expert_parallel if tensor.expert else 1
                nbytes = sum(shape.numel() for _, shape in tensor.hf) * dtype.itemsize * copies
                if current and (size + nbytes > bucket_bytes or current[-1].expert != tensor.expert):
                    out.append((stage, current))
                    current, size = [], 0
                current.append(tensor)
                size += nbytes
            if current:
                out.append((stage, current))
        return out


def read_safetensors(path: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of an HF directory's safetensors files (each read from its file)."""
    from safetensors import safe_open

    wanted = set(names)
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in wanted.intersection(f.keys()):
                out[name] = f.get_tensor(name)
    return out


def gather_bucket(
    tensors: list[PlannedTensor],
    params: Mapping[str, torch.Tensor],
    plan: WeightPlan,
    ranks: MegatronRanks,
    dtype: torch.dtype | None,
) -> torch.Tensor | None:
    """The bucket's whole HF tensors (in ``dtype``, default the parameters'), back to back in one flat
    buffer, on the stage's first TP rank (``unpack`` cuts them out with ``plan.hf_shapes``); the other
    TP ranks take part in the all-gather and get None. An expert bucket: on every EP rank of the group
    (``plan.gathered_by``), each EP rank's experts in turn."""
    target = dtype or params[tensors[0].local].dtype
    flat = torch.cat([params[t.local].detach().reshape(-1).to(target) for t in tensors])
    if ranks.tensor_size > 1:
        gathered = flat.new_empty(ranks.tensor_size, flat.numel())
        dist.all_gather(list(gathered.unbind(0)), flat, group=ranks.tensor_group)
    else:
        gathered = flat[None]
    if ranks.tensor_rank != 0:
        return None
    whole = []
    offset = 0
    for t in tensors:
        parts = [row[offset : offset + t.shard_numel].view(t.shard_shape) for row in gathered]
        offset += t.shard_numel
        merged = merge_tensor(t.local, parts, plan.config)
        hf = megatron_param_to_hf(
            t.source, merged, plan.config, transformer_engine=plan.layout.transformer_engine
        )
        whole += [tensor.reshape(-1) for _, tensor in hf]
    merged = torch.cat(whole)
    if tensors[0].expert and ranks.expert_size > 1:
        experts = merged.new_empty(ranks.expert_size, merged.numel())
        dist.all_gather(list(experts.unbind(0)), merged, group=ranks.expert_group)
        merged = experts.reshape(-1)
    return merged


def unpack(flat: torch.Tensor, shapes: list[tuple[str, torch.Size]]) -> WeightBucket:
    """The HF tensors of a bucket as views of its flat buffer."""
    out: WeightBucket = []
    offset = 0
    for name, shape in shapes:
        out.append((name, flat[offset : offset + shape.numel()].view(shape)))
        offset += shape.numel()
    return out


def export_buckets(
    plan: WeightPlan,
    params: Mapping[str, torch.Tensor],
    ranks: MegatronRanks,
    bucket_bytes: int,
    dtype: torch.dtype,
) -> Iterator[WeightBucket]:
    """Whole HF tensors in ``dtype`` bucket by bucket on global rank 0 (the first replica's first
    stage's first TP rank); every rank yields as many buckets, the others empty ones. A later stage's
    bucket is gathered on that stage's first TP rank of the first replica and sent to rank 0."""
    lead_of_stage = ranks.is_first_replica and ranks.tensor_rank == 0
    for stage, tensors in plan.buckets(bucket_bytes, dtype):
        flat = None
        shapes = plan.hf_shapes(tensors)
        if stage == ranks.pipeline_rank and plan.gathered_by(ranks, tensors):
            flat = gather_bucket(tensors, params, plan, ranks, dtype)
            if not lead_of_stage:
                flat = None
            elif stage != 0:
                dist.send(flat, dst=0)
                flat = None
        elif dist.get_rank() == 0:
            flat = torch.empty(sum(s.numel() for _, s in shapes), dtype=dtype, device=ranks.device)
            dist.recv(flat, src=ranks.stage_ranks[stage])
        yield [] if flat is None else unpack(flat, shapes)
