"""HF <-> Megatron-Core GPT names and tensors for the dense Llama family (Llama, Qwen2/2.5, Qwen3) and the
mixture-of-experts Qwen3-MoE and Mixtral (``experts.py``).

Both directions work on whole, unsharded tensors (``shards`` splits them among ranks):

* ``self_attention.linear_qkv`` fuses q, k and v, grouped by key/value head: for each group ``g``
  the rows of its ``heads / kv_heads`` query heads, then ``k_g``, then ``v_g``. Grouping keeps a
  group's rows together, so tensor-parallel ranks split the fused matrix into contiguous blocks.
* ``mlp.linear_fc1`` is ``[gate; up]`` (Megatron's gated linear unit reads the first half as the
  gate); ``linear_fc2`` is ``down_proj``.
* Norms: Megatron-Core's local layer spec keeps them as modules of their own
  (``input_layernorm``, ``pre_mlp_layernorm``); the Transformer Engine spec fuses them into the next
  linear layer (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``).
* Experts (each layer of an MoE model): the router ``mlp.router.weight`` is HF's ``<block>.gate.weight``;
  expert ``e`` is ``mlp.experts.local_experts.<e>``, its ``linear_fc1`` ``[gate; up]`` and its
  ``linear_fc2`` the down projection, as a dense MLP's (HF's ``<block>.experts.<e>.<gate/up/down>``,
  the names ``save_pretrained`` writes: ``mlp`` and ``gate_proj / up_proj / down_proj`` for Qwen3-MoE,
  ``block_sparse_moe`` and ``w1 / w3 / w2`` for Mixtral). The whole model numbers the experts
  globally; an expert-parallel rank's model numbers its own from 0 (``shards``).
* A tied model has no ``output_layer``: the head is the embedding (HF's ``lm_head.weight``, when a
  state dict carries it, is dropped; it is the same tensor).

An HF tensor with no Megatron name (a bias Megatron's GPT layers do not have, an expert) is refused
naming it, so nothing is dropped silently.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from refractor.models import ModelConfig, UnsupportedModelError

# HF name inside a decoder layer -> Megatron name inside ``decoder.layers.N`` (tensors copied as is)
_LAYER_RENAMES = {
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
# the two layer norms: (HF name, local-spec name, Transformer Engine-spec name)
_LAYER_NORMS = (
    ("input_layernorm.weight", "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
)
_TOP_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
QKV = "self_attention.linear_qkv"
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
FC1 = "mlp.linear_fc1.weight"
FC2 = "mlp.linear_fc2.weight"
ROUTER = "mlp.router.weight"
_HF_EXPERT = re.compile(r"\.experts\.(\d+)\.")
EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")


def expert_name(expert: int, linear: str) -> str:
    """Megatron name (inside ``decoder.layers.N``) of expert ``expert``'s ``linear_fc1`` / ``linear_fc2``."""
    return f"mlp.experts.local_experts.{expert}.{linear}.weight"


def _hf_expert(config: ModelConfig, expert: int, projection: int) -> str:
    """HF name (inside ``model.layers.N``) of an expert's gate (0), up (1) or down (2) projection."""
    moe = config.moe
    return f"{moe.hf_block}.experts.{expert}.{moe.hf_projections[projection]}.weight"


def _mlp_names(config: ModelConfig) -> list[str]:
    if config.moe is None:
        return [FC1, FC2]
    experts = range(config.moe.num_experts)
    return [ROUTER] + [expert_name(e, linear) for e in experts for linear in ("linear_fc1", "linear_fc2")]


def _layer_renames(transformer_engine: bool) -> dict[str, str]:
    norms = {hf: (te if transformer_engine else local) for hf, local, te in _LAYER_NORMS}
    return {**_LAYER_RENAMES, **norms}


def megatron_names(config: ModelConfig, *, transformer_engine: bool = False) -> list[str]:
    """Every tensor name of the whole model's Megatron-Core GPT state dict (``_extra_state`` aside)."""
    renames = [n for n in _layer_renames(transformer_engine).values() if n != FC2]
    per_layer = [QKV + ".weight", *renames, *_mlp_names(config)]
    if config.attention_bias:
        per_layer.append(QKV + ".bias")
    if not config.qk_norm:
        per_layer = [n for n in per_layer if "q_layernorm" not in n and "k_layernorm" not in n]
    names = [f"decoder.layers.{i}.{n}" for i in range(config.num_hidden_layers) for n in per_layer]
    top = [n for n in _TOP_RENAMES.values() if n != "output_layer.weight" or not config.tie_word_embeddings]
    return sorted(names + top)


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """``[q; k; v]`` rows regrouped per key/value head: ``[q heads of group 0, k_0, v_0, q heads of
    group 1, ...]`` (a weight ``[rows, hidden]`` or a bias ``[rows]``)."""
    groups = config.num_key_value_heads
    tail = q.shape[1:]
    parts = (
        q.reshape(groups, config.num_queries_per_kv * config.head_dim, *tail),
        k.reshape(groups, config.head_dim, *tail),
        v.reshape(groups, config.head_dim, *tail),
    )
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``interleave_qkv``: (q, k, v) in HF's row order."""
    groups = config.num_key_value_heads
    per_group = config.num_queries_per_kv * config.head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, per_group + 2 * config.head_dim, *tail)
    q, k, v = grouped.split([per_group, config.head_dim, config.head_dim], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor], config: ModelConfig, *, transformer_engine: bool = False
) -> dict[str, torch.Tensor]:
    """A whole HF state dict in Megatron-Core GPT names (global layer numbers, unpadded vocab)."""
    todo = dict(hf_state)
    if config.tie_word_embeddings:
        todo.pop("lm_head.weight", None)
    out = {mg: todo.pop(hf) for hf, mg in _TOP_RENAMES.items() if hf in todo}
    renames = _layer_renames(transformer_engine)
    for layer in range(config.num_hidden_layers):
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        out.update({mg + m: todo.pop(hf + h) for h, m in renames.items() if hf + h in todo})
        for kind in ("weight", "bias"):
            if hf + f"self_attn.q_proj.{kind}" in todo:
                q, k, v = (_pop(todo, hf + f"self_attn.{p}_proj.{kind}", "HF") for p in "qkv")
                out[mg + f"{QKV}.{kind}"] = interleave_qkv(q, k, v, config)
        if hf + "mlp.gate_proj.weight" in todo:
            gate, up = (_pop(todo, hf + f"mlp.{p}_proj.weight", "HF") for p in ("gate", "up"))
            out[mg + FC1] = torch.cat([gate, up])
        if config.moe is not None:
            out.update(_experts_to_megatron(todo, config, hf, mg))
    _check_complete(out, config, transformer_engine, "the HF state dict lacks the tensors of")
    if todo:
        names = ", ".join(f"`{n}`" for n in sorted(todo)[:4])
        raise UnsupportedModelError(
            f"{len(todo)} HF tensor(s) have no Megatron-Core GPT name ({names}): refractor maps the dense "
            "Llama / Qwen2 / Qwen3 layers (biases on q/k/v only) and the Qwen3-MoE / Mixtral experts"
        )
    return out


def megatron_param_to_hf(
    name: str, tensor: torch.Tensor, config: ModelConfig, *, transformer_engine: bool = False
) -> list[tuple[str, torch.Tensor]] | None:
    """One whole Megatron tensor (global layer number, unpadded vocab) as its HF tensors, in HF's order
    (q, k, v; gate, up); None for a name with no HF counterpart."""
    top = {mg: hf for hf, mg in _TOP_RENAMES.items()}
    if name in top:
        return [(top[name], tensor)]
    match = _LAYER_NAME.fullmatch(name)
    if match is None:
        return None
    hf, rest = f"model.layers.{match[1]}.", match[2]
    renames = {mg: h for h, mg in _layer_renames(transformer_engine).items()}
    if rest in renames:
        return [(hf + renames[rest], tensor)]
    if rest in (f"{QKV}.weight", f"{QKV}.bias"):
        kind = rest.rsplit(".", 1)[1]
        parts = split_qkv(tensor, config)
        return [(hf + f"self_attn.{proj}_proj.{kind}", part) for proj, part in zip("qkv", parts, strict=True)]
    if rest == FC1:
        gate, up = tensor.chunk(2)
        return [(hf + "mlp.gate_proj.weight", gate), (hf + "mlp.up_proj.weight", up)]
    if config.moe is not None:
        return _expert_to_hf(rest, tensor, config, hf)
    return None


def hf_expert_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """The HF names and shapes of every layer's router and experts (an MoE model's MLPs)."""
    moe = config.moe
    hidden = config.hidden_size
    out = {}
    for layer in range(config.num_hidden_layers):
        hf = f"model.layers.{layer}."
        out[hf + f"{moe.hf_block}.gate.weight"] = torch.Size([moe.num_experts, hidden])
        for e in range(moe.num_experts):
            for projection in (0, 1):
                out[hf + _hf_expert(config, e, projection)] = torch.Size([moe.intermediate_size, hidden])
            out[hf + _hf_expert(config, e, 2)] = torch.Size([hidden, moe.intermediate_size])
    return out


def renumber_hf_expert(name: str, offset: int) -> str:
    """An HF expert tensor's name with its expert number moved by ``offset``; other names as they are."""
    return _HF_EXPERT.sub(lambda m: f".experts.{int(m[1]) + offset}.", name)


def _experts_to_megatron(
    todo: dict[str, torch.Tensor], config: ModelConfig, hf: str, mg: str
) -> dict[str, torch.Tensor]:
    """One layer's router and experts (HF prefix ``hf``, Megatron prefix ``mg``), popped from ``todo``."""
    out = {}
    router = hf + f"{config.moe.hf_block}.gate.weight"
    if router in todo:
        out[mg + ROUTER] = todo.pop(router)
    for e in range(config.moe.num_experts):
        if hf + _hf_expert(config, e, 0) in todo:
            gate, up = (_pop(todo, hf + _hf_expert(config, e, p), "HF") for p in (0, 1))
            out[mg + expert_name(e, "linear_fc1")] = torch.cat([gate, up])
        if hf + _hf_expert(config, e, 2) in todo:
            out[mg + expert_name(e, "linear_fc2")] = todo.pop(hf + _hf_expert(config, e, 2))
    return out


def _expert_to_hf(
    rest: str, tensor: torch.Tensor, config: ModelConfig, hf: str
) -> list[tuple[str, torch.Tensor]] | None:
    if rest == ROUTER:
        return [(hf + f"{config.moe.hf_block}.gate.weight", tensor)]
    match = EXPERT.fullmatch(rest)
    if match is None:
        return None
    expert = int(match[1])
    if match[2] == "linear_fc2":
        return [(hf + _hf_expert(config, expert, 2), tensor)]
    gate, up = tensor.chunk(2)
    return [(hf + _hf_expert(config, expert, 0), gate), (hf + _hf_expert(config, expert, 1), up)]


def megatron_to_hf(
    mg_state: Mapping[str, torch.Tensor], config: ModelConfig, *, transformer_engine: bool = False
) -> dict[str, torch.Tensor]:
    """The inverse of ``hf_to_megatron`` (HF's names; a tied model gets no ``lm_head.weight``)."""
    todo = {name: t for name, t in mg_state.items() if not name.endswith("._extra_state")}
    if config.tie_word_embeddings:
        todo.pop("output_layer.weight", None)
    _check_complete(todo, config, transformer_engine, "the Megatron state dict lacks")
    out: dict[str, torch.Tensor] = {}
    unnamed = []
    for name, tensor in todo.items():
        parts = megatron_param_to_hf(name, tensor, config, transformer_engine=transformer_engine)
        if parts is None:
            unnamed.append(name)
        else:
            out.update(parts)
    if unnamed:
        names = ", ".join(f"`{n}`" for n in sorted(unnamed)[:4])
        raise ValueError(f"{len(unnamed)} Megatron tensor(s) have no HF name ({names})")
    return out


def _pop(todo: dict[str, torch.Tensor], name: str, source: str) -> torch.Tensor:
    if name not in todo:
        raise KeyError(f"the {source} state dict has no `{name}`")
    return todo.pop(name)


def _check_complete(state: Mapping, config: ModelConfig, transformer_engine: bool, what: str) -> None:
    missing = sorted(set(megatron_names(config, transformer_engine=transformer_engine)) - state.keys())
    if missing:
        raise KeyError(f"{what} {', '.join(f'`{n}`' for n in missing[:4])}")
