"""A Megatron-Core GPT state dict split among tensor-parallel ranks and pipeline stages, and merged back.

``to_shards(state, config, layout)[pp_rank][tp_rank]`` is the state dict the GPTModel of that rank
loads (``load_state_dict``): its layers numbered from 0 within the stage.

* Column-parallel layers (``linear_qkv``, ``linear_fc1``) split their output rows: rank ``r`` of
  ``t`` holds the ``r``-th block of key/value groups of ``linear_qkv``, and ``[gate_r; up_r]`` of
  ``linear_fc1`` (each half split on its own, so every rank's gated unit pairs matching rows).
* Row-parallel layers (``linear_proj``, ``linear_fc2``) split their input columns. Each expert's
  ``linear_fc1`` and ``linear_fc2`` split as a dense MLP's (Megatron's expert TP is the TP size);
  the router is replicated.
* Expert parallelism (``expert_state``): EP rank ``r`` of ``p`` holds experts
  ``[r E/p, (r+1) E/p)`` of every layer, numbered from 0 in its model (Megatron-Core's
  ``local_expert_indices``); everything else is the same on every EP rank.
* The embedding and the output layer are vocab-parallel: the vocabulary is padded with zero rows to
  a multiple of ``tensor_parallel x make_vocab_size_divisible_by`` and split in row blocks.
* Norms are replicated on every tensor-parallel rank.
* Pipeline stage ``s`` of ``p`` holds layers ``[s L/p, (s+1) L/p)``; the first stage the embedding,
  the last the final norm and the output layer. A tied model with several stages keeps a copy of
  the embedding as the last stage's ``output_layer.weight`` (Megatron-Core keeps the two equal).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from refractor.megatron.mapping import EXPERT, QKV, expert_name, hf_to_megatron, megatron_to_hf
from refractor.models import ModelConfig

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_QKV = (QKV + ".weight", QKV + ".bias")
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "linear_fc2.weight")  # dense MLP and experts
_GLU = "linear_fc1.weight"  # [gate; up] of the dense MLP and of each expert

StageShards = list[dict[str, torch.Tensor]]  # one state dict per tensor-parallel rank


@dataclass(frozen=True)
class MegatronLayout:
    """How one model replica's weights are laid out among its ranks."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # Megatron-LM's default: the padded vocabulary keeps every rank's GEMM a multiple of 128 rows
    make_vocab_size_divisible_by: int = 128
    transformer_engine: bool = False  # Transformer Engine layer names (norms fused into linears)
    expert_parallel: int = 1  # EP ranks share a mixture-of-experts model's experts

    def padded_vocab_size(self, vocab_size: int) -> int:
        multiple = self.tensor_parallel * self.make_vocab_size_divisible_by
        return -(-vocab_size // multiple) * multiple

    def stage_layers(self, config: ModelConfig, stage: int) -> range:
        per_stage = config.num_hidden_layers // self.pipeline_parallel
        return range(stage * per_stage, (stage + 1) * per_stage)

    def check(self, config: ModelConfig) -> None:
        """Refuse a layout the model cannot be split by, naming the sizes."""
        tp, pp = self.tensor_parallel, self.pipeline_parallel
        for what, count in (
            ("attention heads", config.num_attention_heads),
            ("key/value heads", config.num_key_value_heads),
            ("intermediate_size", config.intermediate_size),
        ):
            if count % tp:
                raise ValueError(f"tensor parallel size {tp} does not divide the model's {what} ({count})")
        experts = 0 if config.moe is None else config.moe.num_experts
        if self.expert_parallel > 1 and not experts:
            raise ValueError(f"expert parallel size {self.expert_parallel} needs a mixture-of-experts model")
        if experts % self.expert_parallel:
            raise ValueError(
                f"expert parallel size {self.expert_parallel} does not divide the model's experts ({experts})"
            )
        if config.num_hidden_layers % pp:
            raise ValueError(
                f"pipeline parallel size {pp} does not divide the model's layers ({config.num_hidden_layers})"
            )


def is_tensor_parallel(name: str) -> bool:
    """Whether tensor-parallel ranks hold different parts of tensor ``name`` (else each holds all of it)."""
    return name in (EMBEDDING, OUTPUT) or name.endswith((_GLU, *_QKV, *_ROW_PARALLEL))


def split_tensor(name: str, tensor: torch.Tensor, config: ModelConfig, layout: MegatronLayout):
    tp = layout.tensor_parallel
    if name in (EMBEDDING, OUTPUT):
        padding = layout.padded_vocab_size(config.vocab_size) - tensor.shape[0]
        padded = torch.cat([tensor, tensor.new_zeros(padding, *tensor.shape[1:])])
        return padded.chunk(tp)
    if name.endswith(_GLU):
        gate, up = tensor.chunk(2)
        return [torch.cat(pair) for pair in zip(gate.chunk(tp), up.chunk(tp), strict=True)]
    if name.endswith(_QKV):  # key/value groups stay whole
        return tensor.chunk(tp)
    if name.endswith(_ROW_PARALLEL):
        return tensor.chunk(tp, dim=1)
    return [tensor] * tp


def merge_tensor(name: str, parts: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    if name in (EMBEDDING, OUTPUT):
        return torch.cat(list(parts))[: config.vocab_size]
    if name.endswith(_GLU):
        halves = [part.chunk(2) for part in parts]
        return torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])])
    if name.endswith(_QKV):
        return torch.cat(list(parts))
    if name.endswith(_ROW_PARALLEL):
        return torch.cat(list(parts), dim=1)
    return parts[0]


def global_name(name: str, first_layer: int) -> str:
    """A stage's tensor name with its layer numbered in the whole model (the stage's first layer is
    ``first_layer``); names outside the decoder layers are unchanged."""
    match = _LAYER.fullmatch(name)
    return f"decoder.layers.{int(match[1]) + first_layer}.{match[2]}" if match else name


def experts_per_rank(config: ModelConfig, layout: MegatronLayout) -> int:
    return config.moe.num_experts // layout.expert_parallel


def is_expert(name: str) -> bool:
    """Whether ``name`` (a layer's tensor) is an expert's, which expert-parallel ranks hold apart."""
    match = _LAYER.fullmatch(name)
    return match is not None and EXPERT.fullmatch(match[2]) is not None


def expert_index(name: str) -> int:
    """The expert number in an expert tensor's name."""
    return int(EXPERT.fullmatch(_LAYER.fullmatch(name)[2])[1])


def renumber_expert(name: str, offset: int) -> str:
    """An expert tensor's name with its expert number moved by ``offset`` (local <-> global)."""
    layer = _LAYER.fullmatch(name)
    match = EXPERT.fullmatch(layer[2])
    return f"decoder.layers.{layer[1]}.{expert_name(int(match[1]) + offset, match[2])}"


def expert_state(
    state: Mapping[str, torch.Tensor], config: ModelConfig, layout: MegatronLayout, expert_rank: int
) -> dict[str, torch.Tensor]:
    """The whole-model state dict as EP rank ``expert_rank`` holds it: its experts, numbered from 0."""
    if config.moe is None:
        return dict(state)
    per_rank = experts_per_rank(config, layout)
    first = expert_rank * per_rank
    out = {}
    for name, tensor in state.items():
        if not is_expert(name):
            out[name] = tensor
            continue
        if expert_index(name) in range(first, first + per_rank):
            out[renumber_expert(name, -first)] = tensor
    return out


def merge_expert_states(
    states: Sequence[Mapping[str, torch.Tensor]], config: ModelConfig, layout: MegatronLayout
) -> dict[str, torch.Tensor]:
    """The inverse of ``expert_state``: every EP rank's state dict (rank order) as the whole model's."""
    if len(states) != layout.expert_parallel:
        raise ValueError(f"expected the state dicts of {layout.expert_parallel} expert-parallel ranks")
    out = dict(states[0])
    if config.moe is None:
        return out
    per_rank = experts_per_rank(config, layout)
    out = {name: t for name, t in out.items() if not is_expert(name)}
    for rank, state in enumerate(states):
        out.update({renumber_expert(n, rank * per_rank): t for n, t in state.items() if is_expert(n)})
    return out


def to_shards(
    state: Mapping[str, torch.Tensor], config: ModelConfig, layout: MegatronLayout
) -> list[StageShards]:
    """``[pp_rank][tp_rank] -> state dict`` from a whole-model Megatron state dict (``mapping``)."""
    layout.check(config)
    last = layout.pipeline_parallel - 1
    stages: list[StageShards] = []
    for stage in range(layout.pipeline_parallel):
        layers = layout.stage_layers(config, stage)
        local: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            match = _LAYER.fullmatch(name)
            if match and int(match[1]) in layers:
                local[f"decoder.layers.{int(match[1]) - layers.start}.{match[2]}"] = tensor
        if stage == 0:
            local[EMBEDDING] = state[EMBEDDING]
        if stage == last:
            local[FINAL_NORM] = state[FINAL_NORM]
            if not config.tie_word_embeddings:
                local[OUTPUT] = state[OUTPUT]
            elif last > 0:
                local[OUTPUT] = state[EMBEDDING]
        ranks: StageShards = [{} for _ in range(layout.tensor_parallel)]
        for name, tensor in local.items():
            for rank, part in zip(ranks, split_tensor(name, tensor, config, layout), strict=True):
                rank[name] = part.contiguous()
        stages.append(ranks)
    return stages


def from_shards(shards: Sequence[StageShards], config: ModelConfig, layout: MegatronLayout) -> dict:
    """The whole-model Megatron state dict (global layer numbers, unpadded vocab) from ``to_shards``'s
    layout; ``_extra_state`` entries and a tied model's copy of the embedding on the last stage are
    left out."""
    layout.check(config)
    if len(shards) != layout.pipeline_parallel or any(len(s) != layout.tensor_parallel for s in shards):
        raise ValueError(
            f"expected {layout.pipeline_parallel} stages of {layout.tensor_parallel} shards, got "
            f"{[len(s) for s in shards]}"
        )
    last = layout.pipeline_parallel - 1
    state: dict[str, torch.Tensor] = {}
    for stage, ranks in enumerate(shards):
        offset = layout.stage_layers(config, stage).start
        for name in ranks[0]:
            if name.endswith("._extra_state") or (name == OUTPUT and config.tie_word_embeddings):
                continue
            if name == EMBEDDING and stage != 0 or name in (FINAL_NORM, OUTPUT) and stage != last:
                raise ValueError(f"pipeline stage {stage} holds `{name}`, which belongs to another stage")
            state[global_name(name, offset)] = merge_tensor(name, [rank[name] for rank in ranks], config)
    return state


def hf_to_shards(
    hf_state: Mapping[str, torch.Tensor], config: ModelConfig, layout: MegatronLayout, expert_rank: int = 0
) -> list[StageShards]:
    """An HF state dict as the Megatron-Core GPT state dicts of EP rank ``expert_rank``'s ranks:
    ``[pp_rank][tp_rank]``."""
    whole = hf_to_megatron(hf_state, config, transformer_engine=layout.transformer_engine)
    return to_shards(expert_state(whole, config, layout, expert_rank), config, layout)


def shards_to_hf(
    shards: Sequence[StageShards], config: ModelConfig, layout: MegatronLayout
) -> dict[str, torch.Tensor]:
    """Every rank's Megatron-Core GPT state dict merged back into one HF state dict (one EP rank)."""
    return expert_shards_to_hf([shards], config, layout)


def expert_shards_to_hf(
    shards: Sequence[Sequence[StageShards]], config: ModelConfig, layout: MegatronLayout
) -> dict[str, torch.Tensor]:
    """``[ep_rank][pp_rank][tp_rank]`` state dicts merged back into one HF state dict."""
    states = [from_shards(rank_shards, config, layout) for rank_shards in shards]
    return megatron_to_hf(
        merge_expert_states(states, config, layout), config, transformer_engine=layout.transformer_engine
    )
