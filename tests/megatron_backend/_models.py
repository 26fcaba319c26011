"""Tiny random checkpoints whose shapes split over TP=2 x PP=2: 4 query and 2 key/value heads, 4
layers. Qwen2 is tied (and untied as "qwen2-untied"), with a vocabulary (600) that needs padding;
Llama is untied, with Llama 3.1's RoPE scaling (the one megatron-core implements); Qwen3 has q/k
norms (tied, and untied as "qwen3-untied"), and a vocabulary of 512. The mixture-of-experts models
have 4 experts of 64 per layer, 2 per token: "qwen3-moe" (Qwen3-MoE, top-2 probabilities not
renormalized, tied) and "mixtral" (renormalized, untied)."""

from __future__ import annotations

SHAPE = dict(hidden_size=128, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4)
SHAPE.update(num_key_value_heads=2, head_dim=32)
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


MOE_ARCHS = ("qwen3-moe", "mixtral")


def build(arch: str):
    from refractor import testing

    if arch == "qwen3-moe":
        return testing.tiny_qwen3_moe(**SHAPE, extra={"norm_topk_prob": False})
    if arch == "mixtral":
        return testing.tiny_mixtral(**{**SHAPE, "intermediate_size": 64})

    if arch == "qwen2":
        return testing.tiny_qwen2(**SHAPE, vocab_size=600)
    if arch == "qwen2-untied":
        return testing.tiny_qwen2(**SHAPE, vocab_size=600, tie_word_embeddings=False)
    if arch == "llama":
        return testing.tiny_llama(**SHAPE, rope_scaling=LLAMA31_ROPE, max_position_embeddings=16384)
    if arch == "qwen3-untied":
        return testing.tiny_qwen3(**SHAPE, tie_word_embeddings=False)
    return testing.tiny_qwen3(**SHAPE)
