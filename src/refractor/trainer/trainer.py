"""``Trainer``: one rank of the FSDP2 trainer (a Ray actor wraps it; torchrun or tests run it bare)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from refractor.models.lora import add_lora
from refractor.records import TrainBatch
from refractor.trainer import checkpoint as ckpt
from refractor.trainer import policy_model
from refractor.trainer.context_parallel import ContextGroup
from refractor.trainer.distributed import init_distributed
from refractor.trainer.fp8 import check_fp8, convert_to_float8
from refractor.trainer.memory_plan import DEFAULT_MEMORY_FRACTION, LayerShape, choose_checkpointing
from refractor.trainer.optim import build_lr_scheduler, build_optimizer
from refractor.trainer.policy_model import (
    LM_PREFIX,
    ModelImpl,
    PolicyModel,
    choose_impl,
    hf_name,
    load_lm,
    prepare_layers,
    shard_model,
)
from refractor.trainer.settings import TrainerSettings
from refractor.trainer.step import StepLoop, StepOutcome, StepSettings, run_step
from refractor.trainer.timing import StepTimer
from refractor.weight_sync.gather import WeightBucket, iter_weight_buckets

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Trainer(ckpt.CheckpointedTrainer, StepLoop):
    """See ``refractor.trainer`` for the contract. Construct on every rank with the same settings."""

    def __init__(
        self,
        settings: TrainerSettings,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        master_addr: str | None = None,
        master_port: int | None = None,
        device: str | torch.device | None = None,
        model_impl: ModelImpl = "auto",
        random_init: bool = False,
        compile: bool | None = None,
    ):
        self.settings = settings
        self.info = init_distributed(
            rank, world_size, master_addr=master_addr, master_port=master_port, device=device
        )
        self.rank = self.info.rank
        self.world_size = self.info.world_size
        self.device = self.info.device
        self.checkpoint_dir = settings.checkpoint.root
        # added to every timeline event of this rank (the Ray actor sets its node and GPU)
        self.timeline_attrs: dict[str, Any] = {}

        source, init_checkpoint = self._model_source(settings.model)
        self.model_dir = source
        self.hf_config = json.loads((source / "config.json").read_text())
        master = _DTYPES[settings.model_dtype]
        compute = _DTYPES.get(settings.mixed_precision_dtype or "")
        if not self.info.is_cuda and (master != torch.float32 or compute not in (None, torch.float32)):
            log.info(
                "trainer on CPU: mixed precision is slow or unsupported there; computing in float32 "
                "(model_dtype=%s, mixed_precision_dtype=%s ignored)",
                settings.model_dtype,
                settings.mixed_precision_dtype,
            )
            master = torch.float32
            compute = None
        self.master_dtype = master
        self.compute_dtype = None if compute == master else compute

        self.impl = choose_impl(source, model_impl)
        lm = load_lm(
            source,
            self.impl,
            master,
            self.device,
            random_init=random_init or init_checkpoint is not None,
            seed=settings.seed,
        )
        self.lora = settings.lora
        if self.lora.enabled:
            self._add_adapters(lm)
        self.context = ContextGroup.create(settings.fsdp_context_parallel_size, self.device)
        # ranks of one context-parallel group run the same rows: the batch has one share per group
        self.dp_size = self.world_size // self.context.size
        self.dp_rank = self.rank // self.context.size
        self.model = PolicyModel(lm, self.impl, self.context)
        # ``trainer_compile`` applies on CUDA only (Inductor on CPU needs a C++ toolchain and gains little
        # there); an explicit ``compile=`` argument is obeyed on any device (tests trace on CPU).
        self.compiled = (self.info.is_cuda and settings.trainer_compile) if compile is None else compile
        self.activation_checkpointing = self._checkpointing_mode(settings)
        prepare_layers(
            self.model.layers, checkpoint_activations=self.activation_checkpointing, compile=self.compiled
        )
        if settings.fp8:  # before sharding: FSDP2 then all-gathers the converted weights in float8
            check_fp8(self.device)
            convert_to_float8(self.model, precompute_scales=not settings.fsdp_cpu_offload)
        # after LoRA and fp8 swapped their projections in: only plain Linears are stacked
        stacked = lm.stack_projections() if policy_model.STACK_PROJECTIONS and self.impl == "native" else 0
        shard_model(
            self.model,
            param_dtype=self.compute_dtype,
            reduce_dtype=torch.float32,
            keep_unsharded=self.world_size == 1,
            cpu_offload=settings.fsdp_cpu_offload,
        )
        if init_checkpoint is not None:
            self.load_weights(init_checkpoint)

        optimizer = settings.optimizer
        # the fused AdamW kernel on the GPU and on the host alike (offloaded state steps on the host,
        # where it runs 6-7x the default per-tensor loop: bench/RESULTS.md)
        self.optimizer = build_optimizer(
            [p for p in self.model.parameters() if p.requires_grad],  # LoRA: the adapters only
            optimizer.learning_rate,
            optimizer.weight_decay,
            fused=True,
        )
        self.scheduler = build_lr_scheduler(self.optimizer, optimizer.schedule)
        self.loss_settings = settings.loss
        pad_id = self.hf_config.get("pad_token_id")
        self.step_settings = StepSettings.from_settings(
            settings,
            pad_token_id=pad_id if isinstance(pad_id, int) else 0,
            on_cuda=self.info.is_cuda,
            compiled=self.compiled,
        )
        self._step = 0
        self.skipped_updates = 0
        log.info(
            "trainer rank %d/%d on %s: %s model, master %s, compute %s, activation checkpointing %s, "
            "compiled layers %s, tokens per forward %s, %d projection groups stacked into one GEMM",
            self.rank,
            self.world_size,
            self.device,
            self.impl,
            master,
            self.compute_dtype or master,
            self.activation_checkpointing,
            self.compiled,
            self.step_settings.max_tokens_per_forward or "one row",
            stacked,
        )

    def _add_adapters(self, lm: torch.nn.Module) -> None:
        """LoRA: the base frozen in the compute dtype (no fp32 master copy, no optimizer state),
        adapters in the master dtype. The same adapters on refractor's model and on a model that
        runs on HF transformers (``add_lora``: the decoder layers' projection names)."""
        if self.compute_dtype is not None:
            lm.to(self.compute_dtype)
        count = add_lora(lm, self.lora, self.master_dtype, seed=self.settings.seed)
        log.info(
            "LoRA rank %d (alpha %g) on %s%s: %.2fM parameters train, the rest of the base is frozen",
            self.lora.lora_rank,
            self.lora.lora_alpha,
            ",".join(self.lora.lora_target_modules),
            "".join(f", {name} in full" for name in self.lora.lora_modules_to_save),
            count / 1e6,
        )

    def _checkpointing_mode(self, settings: TrainerSettings) -> bool | str:
        """``activation_checkpointing``, with ``auto`` resolved (``memory_plan``): on CUDA the fastest
        mode whose predicted peak fits ``trainer_memory_fraction`` of this rank's GPU; on CPU, true."""
        mode = settings.activation_checkpointing
        if mode != "auto":
            return mode
        tokens = settings.forward.trainer_max_tokens_per_forward
        if not self.info.is_cuda or tokens <= 0:
            reason = "on CPU" if not self.info.is_cuda else "one pass per row (its length is not known here)"
            log.info("activation_checkpointing auto: true (%s)", reason)
            return True
        fraction = settings.trainer_memory_fraction or DEFAULT_MEMORY_FRACTION
        budget = int(torch.cuda.get_device_properties(self.device).total_memory * fraction)
        trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        frozen = sum(p.numel() * p.element_size() for p in self.model.parameters() if not p.requires_grad)
        chosen, predicted = choose_checkpointing(
            LayerShape.from_hf_config(self.hf_config),
            trained,
            tokens // self.context.size,  # a CP rank holds its share of each pass
            budget,
            self.world_size,
            state_on_gpu=not settings.fsdp_cpu_offload,
            frozen_bytes=frozen,
        )
        log.info(
            "activation_checkpointing auto: %s (predicted peak GiB per rank %s; budget %.1f GiB = "
            "%.2f of the GPU; %d-token passes)",
            str(chosen).lower(),
            {k: round(v, 1) for k, v in predicted.items()},
            budget / 2**30,
            fraction,
            tokens,
        )
        return chosen

    # ------------------------------------------------------------------ model source
    @staticmethod
    def _model_source(model: str) -> tuple[Path, Path | None]:
        """(directory with config.json, native checkpoint to load the weights from or None)."""
        path = Path(model).expanduser()
        if (path / ckpt.META_FILE).is_file():  # a refractor checkpoint used as initial weights
            return path / ckpt.HF_META_DIR, path
        from refractor.hub import resolve_model_path

        return resolve_model_path(model), None

    @property
    def step(self) -> int:
        """Completed training steps (restored by ``load_checkpoint``)."""
        return self._step

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def num_parameters(self) -> int:
        """The whole model's parameter count (sharded parameters report their full size)."""
        return sum(p.numel() for p in self.model.parameters())

    # ------------------------------------------------------------------ training
    def _run_step(self, batch: TrainBatch, timer: StepTimer) -> StepOutcome:
        return run_step(
            self.model,
            self.optimizer,
            batch,
            batch.micro_batches[self.dp_rank],
            self.loss_settings,
            self.step_settings,
            timer,
            self.device,
        )

    # ------------------------------------------------------------------ weight export
    def inference_dtype(self) -> torch.dtype:
        name = self.hf_config.get("dtype") or self.hf_config.get("torch_dtype") or "bfloat16"
        return _DTYPES.get(name, torch.bfloat16)

    def export_weight_buckets(
        self, bucket_mb: int | None = None, dtype: torch.dtype | None = None
    ) -> Iterator[WeightBucket]:
        """Full weights with HF names in buckets of ``bucket_mb`` MiB (default ``weight_broadcast_bucket_mb``)
        cast to ``dtype`` (default: the checkpoint's dtype). Iterate on every rank; rank 0 gets the
        tensors. ``lora_sync: adapter``: the LoRA adapters and their scale instead (the servers hold
        the base they loaded from ``model``, the weights this trainer froze)."""
        mb = bucket_mb or self.settings.weight_broadcast_bucket_mb
        return iter_weight_buckets(
            self.model,
            mb * 2**20,
            dtype or self.inference_dtype(),
            device=self.device,
            adapters=self.lora.pushes_adapters,
        )

    # ------------------------------------------------------------------ checkpoints
    def _state_options(self) -> StateDictOptions:
        """LoRA checkpoints hold the adapters only: the frozen base is the run's ``model``."""
        return (
            StateDictOptions(ignore_frozen_params=True, strict=False)
            if self.lora.enabled
            else StateDictOptions()
        )

    def _hf_model_state(self) -> dict[str, Any]:
        return {
            hf_name(k): v for k, v in get_model_state_dict(self.model, options=self._state_options()).items()
        }

    def _checkpoint_meta(self) -> dict[str, Any]:
        meta = {
            "base_model": self.settings.model,
            "model_impl": self.impl,
            "model_dtype": str(self.master_dtype),
            "trainer_step": self._step,
        }
        if self.lora.enabled:
            meta["lora"] = asdict(self.lora)
            meta["base_model_path"] = str(self.model_dir.resolve())
        return meta

    def _checkpoint_state(self, training_state: bool) -> dict[str, Any]:
        if not training_state:
            return {"model": self._hf_model_state(), "trainer": {"step": self._step}}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_options())
        return {
            "model": {hf_name(k): v for k, v in model_sd.items()},
            "optimizer": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "trainer": {"step": self._step, "skipped_updates": self.skipped_updates},
        }

    def load_checkpoint(self, which: int | str | bool = "latest") -> int:
        """Restore model, optimizer, scheduler, RNG and step from ``step_<N>`` (or the latest); returns N."""
        step, path, meta = self._resumable(which)
        self._check_lora_checkpoint(path, meta)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_options())
        state = {
            "model": {hf_name(k): v for k, v in model_sd.items()},
            "optimizer": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "trainer": {"step": 0, "skipped_updates": 0},
        }
        ckpt.load_checkpoint_state(path, state, restore_rng=True)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict={LM_PREFIX + k: v for k, v in state["model"].items()},
            optim_state_dict=state["optimizer"],
            options=self._state_options(),
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self._step = int(state["trainer"]["step"])
        self.skipped_updates = int(state["trainer"]["skipped_updates"])
        return step

    def _check_lora_checkpoint(self, path: Path, meta: dict[str, Any]) -> None:
        """Adapters resume only on the base and adapter shape they were trained with (``meta``: the
        checkpoint's meta.json)."""
        saved = meta.get("lora")
        mine = asdict(self.lora) if self.lora.enabled else None
        if saved is None and mine is None:
            return
        if saved is None or mine is None:
            raise ckpt.CheckpointError(
                f"{path} holds {'LoRA adapters' if saved else 'full weights'} but this trainer "
                f"{'trains LoRA adapters' if mine else 'trains the full model'} (lora_rank)"
            )
        same_base = meta.get("base_model") == self.settings.model or meta.get("base_model_path") == str(
            self.model_dir.resolve()
        )
        if not same_base:
            raise ckpt.CheckpointError(
                f"{path} holds LoRA adapters for base model {meta.get('base_model')!r}; this run's model "
                f"is {self.settings.model!r}"
            )

        tied = bool(self.hf_config.get("tie_word_embeddings", False))

        def trained_in_full(lora: dict) -> list[str]:
            # on a tied model the head is the embedding: both names train (and save) one tensor
            names = {"embed_tokens" if tied else m for m in lora.get("lora_modules_to_save", ())}
            return sorted(names)

        def shape(lora: dict) -> tuple:
            return int(lora["lora_rank"]), tuple(lora["lora_target_modules"]), trained_in_full(lora)

        def describe(lora: dict) -> str:
            full = "".join(f", {name} in full" for name in trained_in_full(lora))
            return f"rank {lora['lora_rank']} on {','.join(lora['lora_target_modules'])}{full}"

        if shape(saved) != shape(mine):
            raise ckpt.CheckpointError(
                f"{path} holds LoRA adapters of {describe(saved)}; this run asks for {describe(mine)}"
            )

    def load_weights(self, path: str | Path) -> None:
        """Load only the model weights of a native checkpoint (e.g. as a run's initial weights)."""
        if ckpt.read_meta(path).get("lora") or self.lora.enabled:
            raise ckpt.CheckpointError(
                f"{path}: starting from a refractor checkpoint is not supported with LoRA adapters "
                "(in the checkpoint or in this run); start from an HF model directory"
            )
        state = {"model": self._hf_model_state()}
        ckpt.load_checkpoint_state(path, state, restore_rng=False)
        set_model_state_dict(self.model, {LM_PREFIX + k: v for k, v in state["model"].items()})

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
