"""Megatron-Core backend (``train_backend: megatron``; docs/megatron.md).

``layout``          the rules a TP x PP x CP x DP layout must follow (checked at config load; no torch)
``mapping``         HF <-> Megatron-Core GPT names and fused tensors (QKV per key/value group, gate/up)
``shards``          a Megatron state dict split into TP shards and PP stages, and merged back
``weights``         the per-stage plan of those tensors: a rank's shard from HF tensors, and back
``model``           Megatron-Core's GPTModel built from an HF config (needs the ``megatron`` extra)
``attention``       the layers' core attention: refractor's packed attention over a row's samples
``precision``       float32 master weights and gradients for a model computing in bf16 / fp16
``parallel``        Megatron-Core's parallel state on the trainer's process group, a rank's place in it
``forward``         a packed row through a rank's part of the model
``vocab_parallel``  log-probs and entropy on the vocabulary-parallel head
``step``            one training step (stages, gradient sums and norm, AdamW)
``optimizer``       AdamW on the local tensors, its state optionally split among data-parallel replicas
``trainer``         ``MegatronTrainer`` behind the FSDP trainer's interface (``trainer.build_trainer``)
"""
