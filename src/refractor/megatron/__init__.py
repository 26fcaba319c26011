"""Megatron-Core backend (``train_backend: megatron``; docs/megatron.md).

``layout``   the rules a TP x PP x CP x DP layout must follow (checked when the config loads; no torch)
``mapping``  HF <-> Megatron-Core GPT names and fused tensors (QKV interleaved per group, gate/up fused)
``shards``   a Megatron state dict split into tensor-parallel shards and pipeline stages, and merged back
``model``    Megatron-Core's GPTModel built from an HF config (needs the ``megatron`` extra)

The trainer that runs these is not built yet: a config with ``train_backend: megatron`` is refused
with one error once its layout is valid.
"""
