"""One decoder definition for the Llama family (Llama 3, Qwen2/2.5, Qwen3), used by both the
trainer and the native inference engine.

Interface
---------
``load_model(path, dtype=torch.float32, device="cpu") -> CausalLM``
    Reads ``config.json`` + ``*.safetensors`` from a local directory or an HF repo id already in
    the HF cache (offline). Unsupported architectures raise ``UnsupportedModelError`` naming the
    architecture (serve those with vLLM; the trainer falls back to HF ``AutoModelForCausalLM``).
``build_model(hf_config, dtype=None, device=None) -> CausalLM``
    From a ``PretrainedConfig`` or a ``config.json`` dict, with torch's default init. Meta-device
    friendly (``with torch.device("meta"): build_model(cfg)``; then ``to_empty`` and
    ``model.init_weights()`` or a state-dict load). The model has no buffers at all: rope
    frequencies are computed from the positions on every forward.

``CausalLM``
    Parameter names are the HF ones: ``model.embed_tokens.weight``,
    ``model.layers.N.self_attn.{q,k,v,o}_proj.weight`` (+ ``.bias`` on q/k/v for Qwen2),
    ``model.layers.N.self_attn.{q,k}_norm.weight`` (Qwen3), ``model.layers.N.mlp.{gate,up,down}_proj.weight``,
    ``model.layers.N.{input,post_attention}_layernorm.weight``, ``model.norm.weight``,
    ``lm_head.weight`` (untied only). With tied embeddings ``model.lm_head`` is ``None``, the head
    IS ``model.embed_tokens.weight``, and an ``lm_head.weight`` key in a loaded state dict is ignored.
    ``model.model.layers[i]`` is one ``DecoderLayer`` module per layer (FSDP2 ``fully_shard`` per
    layer; activation checkpointing wraps it).

    ``hidden = model(input_ids, position_ids, attention=backend)``
        input_ids, position_ids: int64 ``[T]`` (flat; positions restart at 0 for each packed
        sample) -> final-norm hidden states ``[T, hidden_size]`` (NOT logits).
    ``model.lm_head_weight()`` -> the ``[V, H]`` head weight (tied or not);
    ``model.compute_logits(hidden)`` -> ``hidden @ W.T``.
    ``model.fuse_projections()`` (the inference engine only) runs q/k/v as one GEMM and gate/up
        as one in every layer; ``model.named_hf_parameters()`` and ``get_parameter_by_hf_name``
        still give every HF name (a fused part as a row-slice view of the fused parameter).

Attention backends (``refractor.models.attention``): callables ``(q [T,H,D], k [T,Hkv,D],
v [T,Hkv,D], layer_index) -> [T,H,D]``. ``PackedAttention(document_ids, cu_seqlens, max_seqlen)``
is the training one (block-causal: packed samples never see each other; SDPA with an explicit
mask on CPU, FlexAttention with a document mask on CUDA, falling back to SDPA);
``CausalAttention()`` is one plain causal sequence. The inference engine passes its paged
KV-cache backend instead (``refractor.inference.engine.attention``).

Elementwise glue (RMSNorm, rotary, SiLU-gate) goes through ``refractor.models.ops.ops``: eager
(exact HF numerics) unless a process calls ``enable_compiled_ops`` (the engine does on CUDA).
"""

from refractor.models.attention import AttentionBackend, CausalAttention, PackedAttention
from refractor.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from refractor.models.loading import (
    build_model,
    iter_safetensors,
    load_model,
    read_hf_config,
    resolve_model_path,
)
from refractor.models.model import CausalLM

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionBackend",
    "CausalAttention",
    "CausalLM",
    "ModelConfig",
    "PackedAttention",
    "UnsupportedModelError",
    "build_model",
    "iter_safetensors",
    "load_model",
    "read_hf_config",
    "resolve_model_path",
]
