"""Megatron-Core's GPTModel for an HF Llama / Qwen2 / Qwen3 config, or a Qwen3-MoE / Mixtral one
(``experts.py``; needs the ``megatron`` extra): the local layer spec with refractor's packed attention as
its core attention (``attention.py``), and for a mixture-of-experts model Megatron-Core's MoE layer
(``SequentialMLP`` experts, ``TopKRouter``) with the pieces that run on any device (``moe_layer.py``).

The model takes the weights of ``shards.hf_to_shards`` for its rank. Megatron-Core's parallel state
(``parallel_state.initialize_model_parallel``) must be set up first: the model reads its rank's
tensor-parallel and pipeline-parallel position from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from refractor.megatron.layout import MOE_TENSOR_PARALLEL
from refractor.megatron.shards import MegatronLayout
from refractor.models import ModelConfig, UnsupportedModelError

# megatron-core's llama3 RoPE scaling takes only the factor; the other three are fixed to these
# (Llama 3.1's values), so a checkpoint with other values would get other frequencies
_MEGATRON_LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _rope_arguments(config: ModelConfig) -> dict:
    """GPTModel's RoPE arguments for the HF rope parameters, or a clear refusal."""
    rope = config.rope
    kind = rope["rope_type"]
    arguments = {"position_embedding_type": "rope", "rotary_base": rope["rope_theta"]}
    if kind == "default":
        return arguments
    if kind == "llama3":
        differing = {k: rope.get(k) for k, v in _MEGATRON_LLAMA3_FIXED.items() if rope.get(k) != v}
        if not differing:
            return {**arguments, "rope_scaling": True, "rope_scaling_factor": rope["factor"]}
        raise UnsupportedModelError(
            f"megatron-core's llama3 RoPE scaling fixes {_MEGATRON_LLAMA3_FIXED}; this model has {differing}"
        )
    raise UnsupportedModelError(
        f"rope_type={kind!r}: refractor builds Megatron-Core GPT models with default or llama3 RoPE only"
    )


def transformer_config(config: ModelConfig, layout: MegatronLayout, params_dtype: torch.dtype):
    """Megatron-Core's TransformerConfig for the HF architecture and the layout's sizes.

    Megatron's fused kernels (softmax, bias + activation, RoPE) are CUDA extensions or Transformer
    Engine ops; they are off, so the model runs wherever torch does.
    """
    from megatron.core.transformer import TransformerConfig

    from refractor.megatron.experts import moe_arguments

    if config.mlp_bias:
        raise UnsupportedModelError("an MLP with biases has no Megatron-Core GPT mapping here (mlp_bias)")
    moe = {} if config.moe is None else moe_arguments(config.moe, layout.expert_parallel)
    return TransformerConfig(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=config.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=config.attention_bias,
        qk_layernorm=config.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tensor_parallel,
        pipeline_model_parallel_size=layout.pipeline_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,  # what stages send each other
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,  # the weights come from the checkpoint
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        **moe,
    )


def layer_spec(config: ModelConfig, sequence_parallel: bool = False):
    """Megatron-Core's local layer spec with refractor's packed attention as the core attention; with
    ``sequence_parallel`` its parallel linears gather / reduce-scatter the sequence
    (``sequence_parallel.py``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from refractor.megatron.attention import PackedCoreAttention

    experts = None if config.moe is None else config.moe.num_experts
    spec = get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, qk_layernorm=config.qk_norm, normalization="RMSNorm"
    )
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = PackedCoreAttention
    if experts is not None:
        from refractor.megatron.moe_layer import Router

        spec.submodules.mlp.submodules.router = Router
    if sequence_parallel:
        from refractor.megatron.sequence_linears import SequenceColumnLinear, SequenceRowLinear

        attention.linear_qkv = SequenceColumnLinear
        attention.linear_proj = SequenceRowLinear
        if experts is None:  # the MoE layer's dispatcher gathers and scatters the sequence itself
            mlp = spec.submodules.mlp.submodules
            mlp.linear_fc1 = SequenceColumnLinear
            mlp.linear_fc2 = SequenceRowLinear
    return spec


def build_gpt_model(
    config: ModelConfig,
    layout: MegatronLayout,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
):
    """This rank's GPTModel (local layer spec, ``layer_spec``): its pipeline stage's layers, the embedding
    on the first stage, the final norm and output layer on the last, its tensor-parallel share of each,
    every parameter in ``params_dtype`` (the spec's torch norms are made float32, then cast).
    ``sequence_parallel`` (TP > 1): the layers take and give this rank's block of the sequence.

    Its weights are to be loaded (``shards``), so the construction-time copy of a tied embedding from
    the first stage to the last (an all-reduce of a CUDA copy) is skipped: the model gets no
    embedding group, and the last stage's copy comes from the loaded state dict.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    if layout.transformer_engine:
        raise NotImplementedError("the Transformer Engine layer spec is not built yet (docs/megatron.md)")
    layout.check(config)
    if sequence_parallel and layout.tensor_parallel == 1:
        raise ValueError("sequence parallelism splits the sequence among TP ranks: it needs TP > 1")
    if config.moe is not None and layout.tensor_parallel > 1 and not sequence_parallel:
        raise UnsupportedModelError(MOE_TENSOR_PARALLEL)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.embd = None
    model = GPTModel(
        config=transformer_config(config, layout, params_dtype),
        transformer_layer_spec=layer_spec(config, sequence_parallel),
        vocab_size=layout.padded_vocab_size(config.vocab_size),
        max_sequence_length=config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=config.tie_word_embeddings,
        pg_collection=groups,
        **_rope_arguments(config),
    )
    if config.moe is not None:
        from refractor.megatron.moe_layer import use_every_device_dispatchers

        use_every_device_dispatchers(model, groups, sequence_parallel)
    return model.to(dtype=params_dtype)
