"""Mixture-of-experts models for the Megatron trainer: the HF configs it reads (Qwen3-MoE, Mixtral) and
the Megatron-Core MoE settings that compute what the HF model computes.

Every decoder layer's MLP is a router and ``num_experts`` gated experts: the router's softmax over the
experts, the top ``top_k`` of each token, and (``normalize_top_k``: Qwen3-MoE's ``norm_topk_prob``,
always for Mixtral) those probabilities renormalized to sum to 1; a token's output is the
probability-weighted sum of its experts' outputs. Megatron-Core's ``TopKRouter`` computes the same:
softmax then top-k (``moe_router_pre_softmax``) without renormalization, or, with it, a softmax over the
top-k logits, which is the renormalized top-k softmax. The logits are computed in float32
(``moe_router_dtype``), as HF's router takes its softmax in float32.

An HF model's load-balancing loss (``router_aux_loss_coef``) is part of HF's pre-training loss, not of
refractor's RL loss: Megatron's aux loss is off (coefficient 0, no load-balancing term), so the forward
values and the gradients are the model's own. The attention, embeddings and norms are those of the
dense architecture the model shares them with (Qwen3's q/k norms, Llama's attention for Mixtral).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from refractor.models import ModelConfig, UnsupportedModelError
from refractor.models.config import MoeConfig

# HF architecture -> (dense architecture with the same attention, the layer's MoE module, expert linears
# (gate, up, down)); ``save_pretrained`` writes the experts one by one under these names
MOE_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": ("Qwen3ForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "MixtralForCausalLM": ("LlamaForCausalLM", "block_sparse_moe", ("w1", "w3", "w2")),
}
_BY_MODEL_TYPE = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def moe_refusal(raw: dict[str, Any]) -> str | None:
    """Why the Megatron trainer does not train the mixture-of-experts model of ``raw`` (a
    ``config.json``), one line; None when it does."""
    if _moe_architecture(raw) is None:
        name = ", ".join(raw.get("architectures") or []) or f"model_type {raw.get('model_type')!r}"
        return (
            f"`train_backend: megatron` maps the experts of {', '.join(MOE_ARCHITECTURES)}; this model is "
            f"{name}: use `train_backend: fsdp`"
        )
    try:
        model_config(raw)
    except UnsupportedModelError as error:
        return f"`train_backend: megatron`: {error}"
    return None


def _moe_architecture(raw: dict[str, Any]) -> str | None:
    archs = raw.get("architectures") or []
    found = [a for a in archs if a in MOE_ARCHITECTURES]
    if found:
        return found[0]
    return None if archs else _BY_MODEL_TYPE.get(raw.get("model_type"))


def model_config(raw: dict[str, Any]) -> ModelConfig:
    """The model's ``ModelConfig`` for the Megatron trainer: a dense Llama / Qwen2 / Qwen3 as
    ``ModelConfig.from_hf`` reads it, a Qwen3-MoE or Mixtral with its experts (``moe``); a layout the
    trainer does not build is refused in one line naming the key."""
    arch = _moe_architecture(raw)
    if arch is None:
        return ModelConfig.from_hf(raw)
    dense, block, projections = MOE_ARCHITECTURES[arch]
    if arch == "MixtralForCausalLM":
        experts, size, normalize = raw["num_local_experts"], raw["intermediate_size"], True
        if raw.get("sliding_window"):
            raise UnsupportedModelError(
                f"{arch} with `sliding_window` ({raw['sliding_window']}): the Megatron trainer builds full "
                "causal attention only"
            )
        if raw.get("router_jitter_noise"):
            raise UnsupportedModelError(
                f"{arch} with `router_jitter_noise` ({raw['router_jitter_noise']}): the Megatron trainer "
                "routes without jitter"
            )
    else:
        experts = raw.get("num_experts") or raw["num_local_experts"]
        size, normalize = raw["moe_intermediate_size"], bool(raw.get("norm_topk_prob", False))
        if raw.get("decoder_sparse_step", 1) != 1 or raw.get("mlp_only_layers"):
            raise UnsupportedModelError(
                f"{arch} with dense layers (`decoder_sparse_step`: {raw.get('decoder_sparse_step', 1)}, "
                f"`mlp_only_layers`: {raw.get('mlp_only_layers')}): the Megatron trainer builds models "
                "whose every layer has experts"
            )
    top_k = raw["num_experts_per_tok"]
    if top_k == 1 and normalize:  # Megatron-Core refuses a softmax over one logit (its gradient is 0)
        raise UnsupportedModelError(
            f"{arch} with `num_experts_per_tok` 1 and renormalized top-k probabilities: Megatron-Core's "
            "router has no such mode"
        )
    moe = MoeConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=size,
        normalize_top_k=normalize,
        hf_block=block,
        hf_projections=projections,
    )
    attention = ModelConfig.from_hf(dense_view(raw))
    return dataclasses.replace(attention, architecture=arch, moe=moe)


def dense_view(raw: dict[str, Any]) -> dict[str, Any]:
    """An MoE model's ``config.json`` as the dense architecture it shares its attention, embeddings and
    norms with (each MLP the size of one expert); a dense model's as is."""
    arch = _moe_architecture(raw)
    if arch is None:
        return raw
    size = raw["intermediate_size"] if arch == "MixtralForCausalLM" else raw["moe_intermediate_size"]
    return {**raw, "architectures": [MOE_ARCHITECTURES[arch][0]], "intermediate_size": size}


def moe_arguments(moe: MoeConfig, expert_parallel: int) -> dict[str, Any]:
    """``TransformerConfig``'s MoE arguments (module docstring). The token dispatcher is
    ``moe_layer.EveryDeviceDispatcher``; Megatron's ``allgather`` type is what it extends."""
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.intermediate_size,
        expert_model_parallel_size=expert_parallel,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not moe.normalize_top_k,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )
