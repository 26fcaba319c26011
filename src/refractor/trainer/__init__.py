"""The FSDP2 trainer: one process per rank (a Ray actor in a run; torchrun or a test otherwise).

Entry point
-----------
``TrainerSettings.from_config(cfg)`` (``refractor.trainer.settings``)
    The config keys the trainer reads, as a frozen, picklable dataclass with typed sections:
    ``optimizer`` (AdamW, ``grad_clip``, LR schedule), ``forward`` (temperature, chunking, passes),
    ``loss`` (``LossSettings``) and ``checkpoint`` (directory, retention, resume). Field names are
    the config keys; the dataclass defaults equal the schema's. ``from_config`` only reads
    attributes, and ``TrainerSettings.from_keys(model=..., **keys)`` builds the settings from plain
    keys, so the trainer runs where pydantic is absent (GPU device images).

``Trainer(settings, rank=None, world_size=None, *, master_addr=None, master_port=None, device=None,
model_impl="auto", random_init=False, compile=None)``
    Joins (or creates) the default process group: NCCL on CUDA, gloo on CPU; missing rank/world/
    address come from torchrun's environment, a lone process is rank 0 of 1. Loads ``settings.model``
    (an HF directory / cached id / ``refractor-testing/...``, or a native checkpoint directory whose
    weights become the initial weights), with refractor's shared model for Llama/Qwen2/Qwen3 and
    HF ``AutoModelForCausalLM`` otherwise (``model_impl`` forces one). Master weights in
    ``model_dtype``, compute in ``mixed_precision_dtype`` with fp32 gradient reduction (CPU: all
    fp32, logged), activation checkpointing per decoder layer (``activation_checkpointing``),
    FSDP2 ``fully_shard`` per layer + root (gradients summed: the loss is globally normalized),
    AdamW, the LR schedules of docs/algorithms.md. On CUDA, ``trainer_compile`` (default on; or
    ``compile=``) compiles each decoder layer with its activation checkpoint, and the rows of a
    minibatch are concatenated into passes of ``trainer_max_tokens_per_forward`` tokens (``rows.py``),
    padded to multiples of ``trainer_pass_pad_multiple`` when compiled (a few static lengths).
    Checkpoints go to ``checkpoint_dir``, else ``<run_dir>/<run_name>/checkpoints``.

``trainer.train_step(batch: TrainBatch) -> StepResult``
    Call on every rank with the same batch (``refractor.algorithms.packing.pack_train_batch`` with
    ``num_dp_ranks = trainer.dp_size``, the world size over ``fsdp_context_parallel_size``); each rank
    runs ``batch.micro_batches[trainer.dp_rank]``, its context-parallel group's share
    (``context_parallel.py``). Metrics (identical
    on every rank): ``loss`` (the step objective), ``entropy``, ``kl_divergence_inference``,
    ``grad_norm`` (pre-clip, mean over minibatches), ``learning_rate`` (the LR this step used), the
    optional loss metrics, ``timing_<span>_total`` seconds (CUDA events / wall clock),
    ``timing_step_active``, ``timing_microbatch_count``, ``trainer/batch/...``,
    ``trainer/optimizer/skipped_updates[_total]`` (non-finite grad norm: update skipped),
    ``trainer/throughput/tokens_per_s``, ``trainer/memory/peak_allocated_gb`` (CUDA).
    ``StepResult.timeline`` holds this rank's spans.

``trainer.export_weight_buckets(bucket_mb=None, dtype=None) -> Iterator[list[tuple[str, Tensor]]]``
    Full tensors with HF names, bucket by bucket, cast to the inference dtype. Every rank iterates
    (the gathers are collectives); only rank 0 receives tensors, other ranks get empty lists. With
    LoRA: the merged weights, or with ``lora_sync: adapter`` the adapters and their scale alone.

``trainer.save_checkpoint(step=None, extra_files=None) -> Path``
    Collective. Atomic ``<checkpoint_dir>/step_<N>`` (DCP shards, RNG, hf_meta/, meta.json,
    ``extra_files`` such as ``{"orchestrator.json": ...}``), then retention.
``trainer.load_checkpoint(which="latest" | N) -> N``; ``trainer.maybe_resume()`` applies
``resume_from_checkpoint``; ``trainer.step`` counts completed steps; ``trainer.shutdown()``.

``build_trainer(settings, rank, world_size, **kwargs)``
    The trainer of ``settings.train_backend``: this ``Trainer`` (``fsdp``) or
    ``refractor.megatron.trainer.MegatronTrainer`` (``megatron``, docs/megatron.md), which has the same
    methods and metrics; ``trainer.num_parameters`` is the whole model's count on every rank.

Offline: ``refractor convert CHECKPOINT OUT`` (``refractor.trainer.convert``) writes an HF directory.
Imports are lazy so that ``refractor`` CLI commands stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from refractor.trainer.settings import TrainerSettings
    from refractor.trainer.trainer import Trainer

__all__ = ["Trainer", "TrainerSettings", "build_trainer"]


def build_trainer(
    settings: TrainerSettings, rank: int | None = None, world_size: int | None = None, **kwargs: Any
):
    """The trainer rank of ``settings.train_backend`` (keyword arguments: ``master_addr``,
    ``master_port``, ``device``)."""
    if settings.train_backend == "megatron":
        from refractor.megatron.trainer import MegatronTrainer

        return MegatronTrainer(settings, rank, world_size, **kwargs)
    from refractor.trainer.trainer import Trainer

    return Trainer(settings, rank, world_size, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from refractor.trainer.trainer import Trainer

        return Trainer
    if name == "TrainerSettings":
        from refractor.trainer.settings import TrainerSettings

        return TrainerSettings
    raise AttributeError(name)
