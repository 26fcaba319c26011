"""The Megatron trainer's checkpoints, in refractor's checkpoint directory (``trainer/checkpoint.py``).

The weights are saved as whole HF tensors (each stage's first rank of the first replica writes its
stage's, gathered over TP and, for experts, EP), so ``refractor convert`` and ``model: <checkpoint>``
work as for FSDP checkpoints and either backend starts from them. The AdamW state is saved per shard
(its stage, TP rank, an expert's EP rank, its name) in its storage dtypes, so a resume needs the same
TP x PP (x EP) layout and moment dtypes (the data-parallel and CP sizes may change); anything else is
refused naming both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from refractor.megatron.precision import dtype_name
from refractor.megatron.weights import gather_bucket, unpack
from refractor.trainer import checkpoint as ckpt

BACKEND = "megatron"


class MegatronCheckpoints(ckpt.CheckpointedTrainer):
    """``save_checkpoint`` / ``load_checkpoint`` / ``maybe_resume`` of ``MegatronTrainer``, which
    provides what they read: ``settings``, ``plan``, ``ranks``, ``params``, ``optimizer``,
    ``scheduler``, ``layout``, ``moment_dtypes``, ``expert_names``, ``master_dtype``, ``device``,
    ``model_dir``, ``checkpoint_dir``, ``_step``, ``skipped_updates`` and ``_load_hf``."""

    def _stage_hf_weights(self) -> dict[str, torch.Tensor]:
        """This stage's weights as whole HF tensors on its first replica's first TP rank ({} elsewhere)."""
        out: dict[str, torch.Tensor] = {}
        for stage, tensors in self.plan.buckets(
            self.settings.weight_broadcast_bucket_mb * 2**20, self.master_dtype
        ):
            if stage != self.ranks.pipeline_rank or not self.plan.gathered_by(self.ranks, tensors):
                continue
            flat = gather_bucket(tensors, self.params, self.plan, self.ranks, None)
            if flat is not None and self.ranks.is_first_replica:
                out.update(unpack(flat, self.plan.hf_shapes(tensors)))
        return out

    def _optimizer_key(self, name: str) -> str:
        """Optimizer state is saved per shard: its stage, its TP rank, (an expert's) its EP rank, its name
        in the stage's model."""
        expert = f"ep{self.ranks.expert_rank}." if name in self.expert_names else ""
        return f"pp{self.ranks.pipeline_rank}.tp{self.ranks.tensor_rank}.{expert}{name}"

    def _checkpoint_state(self, training_state: bool) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self._stage_hf_weights(), "trainer": {"step": self._step}}
        if training_state:
            state["optimizer"] = {self._optimizer_key(n): s for n, s in self.optimizer.state().items()}
            state["scheduler"] = self.scheduler.state_dict()
            state["trainer"]["skipped_updates"] = self.skipped_updates
        return state

    def _layout_meta(self) -> dict[str, int]:
        meta = {
            "tensor_parallel": self.layout.tensor_parallel,
            "pipeline_parallel": self.layout.pipeline_parallel,
        }
        if self.layout.expert_parallel > 1:
            meta["expert_parallel"] = self.layout.expert_parallel
        return meta

    def _moments_meta(self) -> dict[str, str]:
        return {
            "exp_avg": dtype_name(self.moment_dtypes.exp_avg),
            "exp_avg_sq": dtype_name(self.moment_dtypes.exp_avg_sq),
        }

    def _checkpoint_meta(self) -> dict[str, Any]:
        return {
            "backend": BACKEND,
            "base_model": self.settings.model,
            "model_impl": "native",
            "model_dtype": str(self.master_dtype),
            "trainer_step": self._step,
            "megatron": self._layout_meta(),
            "adamw_moments": self._moments_meta(),
        }

    def load_checkpoint(self, which: int | str | bool = "latest") -> int:
        """Restore weights, AdamW state, scheduler, RNG and step from ``step_<N>`` (or the latest)."""
        step, path, meta = self._resumable(which)
        if meta.get("backend") != BACKEND or meta.get("megatron") != self._layout_meta():
            saved = meta.get("megatron") or meta.get("backend", "fsdp")
            raise ckpt.CheckpointError(
                f"{path} was saved by the {meta.get('backend', 'fsdp')} trainer with layout {saved}; this "
                f"run is megatron {self._layout_meta()}: its optimizer state is per shard, so resume with "
                f"the same layout, or start a new run from its weights with `model: {path}`"
            )
        saved = meta.get("adamw_moments", {"exp_avg": "float32", "exp_avg_sq": "float32"})
        if saved != self._moments_meta():
            raise ckpt.CheckpointError(
                f"{path} holds AdamW moments stored as {saved}; this run stores them as "
                f"{self._moments_meta()}: set `megatron_exp_avg_dtype` / `megatron_exp_avg_sq_dtype` as "
                f"saved, or start a new run from its weights with `model: {path}`"
            )
        state = {
            "model": self._empty_hf(
                self.plan.needed_hf_names(self.ranks.pipeline_rank, self.ranks.expert_rank)
            ),
            "optimizer": {self._optimizer_key(n): s for n, s in self.optimizer.state().items()},
            "scheduler": self.scheduler.state_dict(),
            "trainer": {"step": 0, "skipped_updates": 0},
        }
        ckpt.load_checkpoint_state(path, state, restore_rng=True)
        self._load_hf(state["model"])
        self.optimizer.load_state(
            {n: state["optimizer"][self._optimizer_key(n)] for n in self.optimizer.owned}
        )
        self.scheduler.load_state_dict(state["scheduler"])
        for group, lr in zip(self.optimizer.adamw.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
        self._step = int(state["trainer"]["step"])
        self.skipped_updates = int(state["trainer"]["skipped_updates"])
        return step

    def _empty_hf(self, names: list[str]) -> dict[str, torch.Tensor]:
        skeleton = self.plan.skeleton
        return {n: torch.empty(skeleton[n].shape, dtype=self.master_dtype, device=self.device) for n in names}

    def _read_checkpoint_weights(self, path: Path, names: list[str]) -> dict[str, torch.Tensor]:
        """A refractor checkpoint's weights (HF names, either backend) that this stage needs."""
        if ckpt.read_meta(path).get("lora"):
            raise ckpt.CheckpointError(
                f"{path} holds LoRA adapters; the Megatron trainer starts from whole weights (an HF "
                "directory, or `refractor convert` the checkpoint first)"
            )
        state = {"model": self._empty_hf(names)}
        ckpt.load_checkpoint_state(path, state, restore_rng=False)
        return state["model"]
