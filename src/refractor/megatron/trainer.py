"""``MegatronTrainer``: one rank of the Megatron-Core trainer, behind the FSDP ``Trainer``'s interface.

The orchestrator, the weight sync and the run store call the same methods with the same records:
``train_step(TrainBatch) -> StepResult`` (the same metrics), ``export_weight_buckets`` (whole HF
tensors in buckets on rank 0), ``save_checkpoint`` / ``load_checkpoint`` / ``maybe_resume``
(refractor's checkpoint directory: HF-named weights, so ``refractor convert`` and ``model:
<checkpoint>`` work as for FSDP checkpoints), ``shutdown``.

A rank holds its tensor-parallel shard of its pipeline stage of Megatron-Core's ``GPTModel`` (local
layer spec), loaded from the HF weights through the mapping (``weights.WeightPlan``); with context
parallelism it runs its share of every row (``forward.py``); of a mixture-of-experts model
(``experts.py``) it holds its expert-parallel rank's experts. The step
(``step.py``) runs the shared loss on a vocabulary-parallel head; AdamW is torch's on the local
tensors (``optimizer.py``). Precision (``precision.py``): the model computes in
``mixed_precision_dtype`` (bfloat16 by default; null: float32) on CUDA, and in float32 on CPU unless
``mixed_precision=True`` is passed, as the FSDP trainer decides; master weights, gradients, their
reductions and the AdamW state are float32 (``model_dtype`` must be float32) unless the
precision-aware optimizer's keys say otherwise; ``megatron_optimizer_cpu_offload`` steps a share of
the parameters on the host (``optimizer.py``). Attention over packed rows is refractor's own
(``attention.py``), and on CUDA a minibatch's rows are concatenated into passes of
``trainer_max_tokens_per_forward`` tokens as the FSDP trainer concatenates them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from refractor.megatron import parallel
from refractor.megatron.checkpointing import BACKEND, MegatronCheckpoints
from refractor.megatron.experts import model_config
from refractor.megatron.layout import ParallelSizes
from refractor.megatron.optimizer import MegatronOptimizer, Offload, grad_reduce_dtype, optimizer_precision
from refractor.megatron.precision import MASTER_DTYPE, MasterWeights, dtype_name
from refractor.megatron.shards import EMBEDDING, OUTPUT, MegatronLayout, is_expert
from refractor.megatron.step import StageModel, norm_parameters, run_step, tensor_summed_parameters
from refractor.megatron.weights import (
    WeightBucket,
    WeightPlan,
    export_buckets,
    read_safetensors,
)
from refractor.records import TrainBatch
from refractor.trainer import checkpoint as ckpt
from refractor.trainer.distributed import init_distributed
from refractor.trainer.optim import build_lr_scheduler
from refractor.trainer.policy_model import prepare_layers
from refractor.trainer.settings import TrainerSettings
from refractor.trainer.step import StepLoop, StepOutcome, StepSettings
from refractor.trainer.timing import StepTimer

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class MegatronTrainer(MegatronCheckpoints, StepLoop):
    """See the module docstring and ``refractor.trainer`` for the contract. Construct on every rank."""

    impl = BACKEND

    def __init__(
        self,
        settings: TrainerSettings,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        master_addr: str | None = None,
        master_port: int | None = None,
        device: str | torch.device | None = None,
        mixed_precision: bool | None = None,
    ):
        """``mixed_precision``: None applies ``mixed_precision_dtype`` on CUDA only (a CPU rank computes in
        float32, logged, as the FSDP trainer does); True applies it on any device; False computes in
        float32."""
        self.settings = settings
        parallel.quiet_fallback_warnings()
        self.info = init_distributed(
            rank, world_size, master_addr=master_addr, master_port=master_port, device=device
        )
        self.rank = self.info.rank
        self.world_size = self.info.world_size
        self.device = self.info.device
        self.master_dtype = MASTER_DTYPE
        self.compute_dtype = _compute_dtype(settings, self.info.is_cuda, mixed_precision)
        self.checkpoint_dir = settings.checkpoint.root
        self.timeline_attrs: dict[str, Any] = {}
        mg = settings.megatron
        sizes = ParallelSizes(
            tensor=mg.megatron_tensor_parallel_size,
            pipeline=mg.megatron_pipeline_parallel_size,
            context=mg.megatron_context_parallel_size,
            expert=mg.megatron_expert_parallel_size,
            sequence_parallel=mg.megatron_sequence_parallel,
        )
        if sizes.sequence_parallel and sizes.tensor == 1:
            raise ValueError(
                "`megatron_sequence_parallel: true` needs `megatron_tensor_parallel_size` > 1 (it splits "
                "the sequence among the tensor-parallel ranks)"
            )
        if self.world_size % sizes.model_parallel:
            raise ValueError(
                f"{self.world_size} trainer ranks do not split into TP {sizes.tensor} x PP {sizes.pipeline} "
                f"x CP {sizes.context} model replicas"
            )
        if sizes.data_parallel(self.world_size) % sizes.expert:
            raise ValueError(
                f"`megatron_expert_parallel_size` ({sizes.expert}) must divide the "
                f"{sizes.data_parallel(self.world_size)} data-parallel ranks: the experts are shared "
                "among them"
            )
        self.ranks = parallel.start(sizes, self.device)
        self.dp_size = self.ranks.data_size
        self.dp_rank = self.ranks.data_rank

        source, init_checkpoint = _model_source(settings.model)
        self.model_dir = source
        self.hf_config = json.loads((source / "config.json").read_text())
        self.config = model_config(self.hf_config)
        self.layout = MegatronLayout(
            tensor_parallel=sizes.tensor, pipeline_parallel=sizes.pipeline, expert_parallel=sizes.expert
        )
        self.plan = WeightPlan.build(self.hf_config, self.layout)
        from refractor.megatron.model import build_gpt_model

        torch.manual_seed(settings.seed)
        self.model = build_gpt_model(
            self.config, self.layout, self.compute_dtype, sequence_parallel=sizes.sequence_parallel
        ).to(self.device)
        rotary = self.model.rotary_pos_emb  # its frequencies are a plain attribute, which Module.to leaves
        rotary.inv_freq = rotary.inv_freq.to(self.device)
        self.moment_dtypes, grads_in_compute_dtype = optimizer_precision(mg, self.compute_dtype)
        self.weights = MasterWeights(self.model, grads_in_compute_dtype)
        self.params = self.weights.master  # what AdamW steps, the export and checkpoints read
        grads = self.weights.grads  # what holds the gradients the step reduces and clips
        stage = self.ranks.pipeline_rank
        names = self.plan.needed_hf_names(stage, self.ranks.expert_rank)
        if init_checkpoint is None:
            hf = read_safetensors(source, names)
        else:  # a refractor checkpoint's weights (HF names) as the initial weights
            hf = self._read_checkpoint_weights(init_checkpoint, names)
        self._load_hf(hf)
        if mg.megatron_gradient_checkpointing:
            prepare_layers(self.model.decoder.layers, checkpoint_activations=True, compile=False)

        optimizer = settings.optimizer
        offload = None
        if mg.megatron_optimizer_cpu_offload:
            offload = Offload(
                mg.megatron_optimizer_offload_fraction, mg.megatron_overlap_cpu_optimizer_d2h_h2d
            )
        self.expert_names = frozenset(name for name in self.params if is_expert(name))
        self.optimizer = MegatronOptimizer(
            self.weights,
            optimizer.learning_rate,
            optimizer.weight_decay,
            self.ranks,
            distributed=mg.megatron_use_distributed_optimizer,
            moments=self.moment_dtypes,
            offload=offload,
            own_names=self.expert_names if sizes.expert > 1 else frozenset(),
        )
        self.scheduler = build_lr_scheduler(self.optimizer.adamw, optimizer.schedule)
        self.loss_settings = settings.loss
        pad_id = self.hf_config.get("pad_token_id")
        self.step_settings = StepSettings.from_settings(
            settings,
            pad_token_id=pad_id if isinstance(pad_id, int) else 0,
            on_cuda=self.info.is_cuda,
            compiled=False,
        )
        # every pass splits into 2 x CP chunks (StepSettings.pass_multiple), and under sequence
        # parallelism a CP rank's share into TP blocks
        multiple = self.step_settings.pass_pad_multiple
        if sizes.sequence_parallel:
            multiple = math.lcm(multiple or 1, sizes.tensor * sizes.context)
        self.step_settings = dataclasses.replace(
            self.step_settings, pass_pad_multiple=multiple, context_parallel_size=sizes.context
        )
        tied_copy = None
        if self.config.tie_word_embeddings and self.ranks.embedding_group is not None:
            tied_copy = grads[EMBEDDING if self.ranks.is_first_stage else OUTPUT]
        self.stage = StageModel(
            self.model,
            self.ranks,
            self.config.vocab_size,
            self.config.hidden_size,
            self.compute_dtype,
            tied_copy,
            norm_parameters(grads, self.ranks, tied_copy),
            tensor_summed_parameters(grads, sizes.sequence_parallel),
            sizes.sequence_parallel,
            grad_reduce_dtype(mg, grads, self.compute_dtype),
            tuple(grads[name] for name in sorted(self.expert_names)),
        )
        self._step = 0
        self.skipped_updates = 0
        log.info(
            "megatron trainer rank %d/%d on %s: TP %d x PP %d x CP %d x DP %d, EP %d (stage %d, TP rank "
            "%d), sequence parallelism %s, compute in %s (master weights float32, gradients %s, AdamW "
            "moments %s / %s), layer recompute %s, AdamW state %s, %d of %d owned parameters stepped on "
            "the host",
            self.rank,
            self.world_size,
            self.device,
            sizes.tensor,
            sizes.pipeline,
            sizes.context,
            self.dp_size,
            sizes.expert,
            stage,
            self.ranks.tensor_rank,
            sizes.sequence_parallel,
            dtype_name(self.compute_dtype),
            dtype_name(next(iter(grads.values())).dtype),
            dtype_name(self.moment_dtypes.exp_avg),
            dtype_name(self.moment_dtypes.exp_avg_sq),
            mg.megatron_gradient_checkpointing,
            "split among the replicas" if self.optimizer.replicas > 1 else "whole on every replica",
            len(self.optimizer.offloaded),
            len(self.optimizer.owned),
        )

    def _load_hf(self, hf: Mapping[str, torch.Tensor]) -> None:
        ranks = self.ranks
        state = self.plan.stage_state(hf, ranks.pipeline_rank, ranks.tensor_rank, ranks.expert_rank)
        self.model.load_state_dict(state, strict=True)
        self.weights.load(state)

    @property
    def step(self) -> int:
        return self._step

    @property
    def learning_rate(self) -> float:
        return self.optimizer.learning_rate

    @property
    def num_parameters(self) -> int:
        """The whole model's parameter count (a tied head counted once)."""
        return sum(shape.numel() for shape in (t.shape for t in self.plan.skeleton.values()))

    # ------------------------------------------------------------------ training
    def _run_step(self, batch: TrainBatch, timer: StepTimer) -> StepOutcome:
        return run_step(
            self.stage,
            self.optimizer,
            list(self.weights.grads.values()),
            batch,
            batch.micro_batches[self.dp_rank],
            self.loss_settings,
            self.step_settings,
            timer,
        )

    # ------------------------------------------------------------------ weight export
    def inference_dtype(self) -> torch.dtype:
        name = self.hf_config.get("dtype") or self.hf_config.get("torch_dtype") or "bfloat16"
        return _DTYPES.get(name, torch.bfloat16)

    def export_weight_buckets(
        self, bucket_mb: int | None = None, dtype: torch.dtype | None = None
    ) -> Iterator[WeightBucket]:
        """Whole weights with HF names in buckets of ``bucket_mb`` MiB (default
        ``weight_broadcast_bucket_mb``) cast to ``dtype`` (default: the checkpoint's dtype). Iterate on
        every rank; rank 0 gets the tensors, the other ranks empty lists."""
        mb = bucket_mb or self.settings.weight_broadcast_bucket_mb
        return export_buckets(self.plan, self.params, self.ranks, mb * 2**20, dtype or self.inference_dtype())

    def shutdown(self) -> None:
        parallel.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def _compute_dtype(settings: TrainerSettings, on_cuda: bool, mixed_precision: bool | None) -> torch.dtype:
    """The model's dtype (``MegatronTrainer``'s ``mixed_precision``); master weights are float32 only."""
    if settings.model_dtype != "float32":
        raise ValueError(
            f"`model_dtype: {settings.model_dtype}`: the Megatron trainer keeps float32 master weights "
            "(AdamW steps them); set `model_dtype: float32` and `mixed_precision_dtype` for the compute dtype"
        )
    wanted = _DTYPES[settings.mixed_precision_dtype] if settings.mixed_precision_dtype else MASTER_DTYPE
    applies = on_cuda if mixed_precision is None else mixed_precision
    if applies:
        return wanted
    if wanted != MASTER_DTYPE and mixed_precision is None:
        log.info(
            "megatron trainer on CPU: computing in float32 (mixed_precision_dtype=%s applies on CUDA)",
            settings.mixed_precision_dtype,
        )
    return MASTER_DTYPE


def _model_source(model: str) -> tuple[Path, Path | None]:
    """(directory with config.json, refractor checkpoint to take the weights from or None)."""
    path = Path(model).expanduser()
    if (path / ckpt.META_FILE).is_file():
        return path / ckpt.HF_META_DIR, path
    from refractor.hub import resolve_model_path

    return resolve_model_path(model), None
