"""``TrainerSettings``: the config keys the trainer reads, as typed sections, read once from the config.

Field names are the config keys, so a section reads like the YAML it came from. The dataclass
defaults are the trainer's only copy of the defaults; a test asserts that each equals the
``RefractorConfig`` schema default of the same key. This module imports neither pydantic nor
``refractor.config``: ``from_config`` only reads attributes, and ``from_keys`` builds the settings
from plain keys where pydantic is absent (GPU device images).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from refractor.algorithms.loss import LossSettings
from refractor.models.lora import LoraSettings
from refractor.trainer.optim import LRSchedule


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW, gradient clipping and the learning-rate schedule (``optim.py``)."""

    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max gradient norm; 0 reports the norm without clipping
    lr_scheduler: str = "constant"  # none | constant | linear | cosine
    warmup_steps: int = 0
    number_of_steps: int = 300  # the schedule's horizon
    min_lr_ratio: float = 0.0

    @property
    def schedule(self) -> LRSchedule:
        return LRSchedule(self.lr_scheduler, self.warmup_steps, self.number_of_steps, self.min_lr_ratio)


@dataclass(frozen=True)
class ForwardSettings:
    """How the packed rows of a step run through the model (``step.py``, ``rows.py``)."""

    temperature: float = 1.0  # logits are divided by the sampling temperature
    entropy_chunk_size: int = 1024
    pad_to_multiple_of: int = 64
    ppo_clip_ref_logprobs: str = "rollout"  # rollout | batch
    trainer_max_tokens_per_forward: int = 16384  # CUDA: rows are concatenated up to this; 0 = one per pass
    trainer_pass_pad_multiple: int = 4096  # compiled CUDA layers: passes padded to a multiple of this


@dataclass(frozen=True)
class CheckpointSettings:
    """Where checkpoints live, what they hold, which ones are kept, and which one a run resumes from."""

    run_dir: str = "runs"
    run_name: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_save_training_state: bool = True
    checkpoint_keep_last: int | None = None
    checkpoint_keep_every: int | None = None
    resume_from_checkpoint: bool | int = False  # true = the latest step, an int = that step

    @property
    def root(self) -> Path | None:
        """``checkpoint_dir``, else ``<run_dir>/<run_name>/checkpoints``; None without a run name."""
        if self.checkpoint_dir:
            return Path(self.checkpoint_dir)
        if self.run_name:
            return Path(self.run_dir) / self.run_name / "checkpoints"
        return None


@dataclass(frozen=True)
class MegatronSettings:
    """The Megatron trainer's layout and options (``train_backend: megatron``; docs/megatron.md)."""

    megatron_tensor_parallel_size: int = 1
    megatron_pipeline_parallel_size: int = 1
    megatron_context_parallel_size: int = 1  # ranks that share each packed row (megatron/forward.py)
    megatron_expert_parallel_size: int = 1  # EP ranks share a mixture-of-experts model's experts
    megatron_gradient_checkpointing: bool = True  # each decoder layer recomputed in the backward
    megatron_use_distributed_optimizer: bool = True  # AdamW state split among data-parallel replicas
    megatron_sequence_parallel: bool = False  # activations outside attention / MLP split over TP ranks
    megatron_optimizer_cpu_offload: bool = False  # a share of the AdamW updates and state on the host
    megatron_optimizer_offload_fraction: float = 1.0  # that share, of the parameters' elements
    megatron_overlap_cpu_optimizer_d2h_h2d: bool = True  # offload copies on a side stream (CUDA)
    megatron_use_precision_aware_optimizer: bool = False  # the dtype keys below apply
    megatron_main_grads_dtype: str = "float32"  # gradients accumulated and reduced in (or bfloat16)
    megatron_main_params_dtype: str = "float32"  # master weights (float32 only)
    megatron_exp_avg_dtype: str = "float32"  # AdamW moments stored in
    megatron_exp_avg_sq_dtype: str = "float32"
    megatron_grad_reduce_in_fp32: bool = True  # false: float32 gradients summed over DP in the compute dtype

    @property
    def model_parallel_size(self) -> int:
        """Ranks that run one data-parallel replica's rows: one copy of the model per CP rank."""
        return (
            self.megatron_tensor_parallel_size
            * self.megatron_pipeline_parallel_size
            * self.megatron_context_parallel_size
        )


_SECTIONS: dict[str, type] = {
    "optimizer": OptimizerSettings,
    "forward": ForwardSettings,
    "loss": LossSettings,
    "checkpoint": CheckpointSettings,
    "lora": LoraSettings,
    "megatron": MegatronSettings,
}


@dataclass(frozen=True)
class TrainerSettings:
    """Everything ``Trainer`` reads: model and precision keys, then one section per concern."""

    model: str  # HF directory / cached id / refractor-testing/..., or a native checkpoint directory
    train_backend: str = "fsdp"  # fsdp | megatron
    model_dtype: str = "float32"  # master weights
    mixed_precision_dtype: str | None = "bfloat16"  # compute; None = the master dtype
    seed: int = 0
    activation_checkpointing: bool | str = "auto"  # true | false | "selective" | "auto"
    trainer_memory_fraction: float | None = None  # auto plans for this share of the GPU (None: 0.9)
    fsdp_cpu_offload: bool = False  # parameters, gradients and AdamW state in host memory
    fsdp_context_parallel_size: int = 1  # ranks that share each packed row (context_parallel.py)
    fp8: bool = False  # decoder projections in float8 through torchao (fp8.py); Hopper/Ada GPUs only
    trainer_compile: bool = True  # CUDA only
    weight_broadcast_bucket_mb: int = 256
    track_gpu_events: bool = True  # false: of the step's spans only the whole `step` (wall clock)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    forward: ForwardSettings = field(default_factory=ForwardSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    megatron: MegatronSettings = field(default_factory=MegatronSettings)

    def data_parallel_size(self, world_size: int) -> int:
        """Replicas among ``world_size`` trainer ranks: one packed share of the batch each."""
        if self.train_backend == "megatron":
            return world_size // self.megatron.model_parallel_size
        return world_size // self.fsdp_context_parallel_size

    @classmethod
    def config_keys(cls) -> list[str]:
        """The config keys the trainer reads: the plain fields and those of every section."""
        keys = []
        for f in fields(cls):
            section = _SECTIONS.get(f.name)
            keys += [g.name for g in fields(section)] if section else [f.name]
        return keys

    @classmethod
    def from_keys(cls, **keys: Any) -> TrainerSettings:
        """Settings from flat config keys (``model`` required), each routed to its section; keys not
        given keep their defaults. Raises TypeError for a key the trainer does not read."""
        unknown = sorted(set(keys) - set(cls.config_keys()))
        if unknown:
            raise TypeError(f"not trainer config keys: {', '.join(unknown)}")
        values = {}
        for f in fields(cls):
            section = _SECTIONS.get(f.name)
            if section is not None:
                values[f.name] = section(**{g.name: keys[g.name] for g in fields(section) if g.name in keys})
            elif f.name in keys:
                values[f.name] = keys[f.name]
        return cls(**values)

    @classmethod
    def from_config(cls, cfg: Any) -> TrainerSettings:
        """The trainer's keys of a ``RefractorConfig`` (attributes only)."""
        return cls.from_keys(**{key: getattr(cfg, key) for key in cls.config_keys()})
