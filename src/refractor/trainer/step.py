"""One training step on one rank: minibatches of packed micro-batches -> forward/backward -> AdamW.

Kept apart from ``Trainer`` (lifecycle, checkpoints, export) so the numerics read top to bottom:

1. micro-batches are grouped by ``MicroBatch.minibatch`` (one optimizer step each), a group's
   rows are concatenated into longer forward passes on CUDA (``rows.py``), and moved to the device;
   ranks agree on the number of passes per minibatch (padding with no-op rows if a producer did not),
   because every forward/backward is a collective under FSDP;
2. ``ppo_clip_ref_logprobs: batch``: a no-grad pass stores the pre-update log-probs as the ratio
   reference for every minibatch;
3. per minibatch: zero_grad, forward + loss (normalized by the minibatch's global normalizer, so
   per-row losses SUM to the minibatch loss) + backward per row, gradient sync only on the last row,
   grad-norm (pre-clip, reported) and clip, AdamW step unless the norm is not finite (counted);
4. the LR scheduler steps once per training step.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from refractor.algorithms.loss import LossSettings, LossStats, loss_metrics, policy_loss
from refractor.algorithms.packing import build_micro_batch
from refractor.records import MicroBatch, StepResult, TrainBatch
from refractor.trainer.distributed import all_reduce_
from refractor.trainer.fp8 import after_optimizer_step
from refractor.trainer.policy_model import PolicyModel
from refractor.trainer.rows import merge_rows, pad_row
from refractor.trainer.settings import TrainerSettings
from refractor.trainer.timing import StepTimer

RATIO_ALGORITHMS = {"cispo", "gspo", "sapo"}


@dataclass(frozen=True)
class StepSettings:
    """What a step reads, resolved for this rank (model pad id, device, compiled layers)."""

    temperature: float
    chunk_size: int
    grad_clip: float
    batch_ref_logprobs: bool  # ppo_clip_ref_logprobs == "batch" and the loss uses a ratio
    pad_token_id: int
    pad_to_multiple_of: int
    max_tokens_per_forward: int = 0  # rows of a minibatch are concatenated up to this (rows.py); 0 = off
    pass_pad_multiple: int = 0  # every pass is padded to a multiple of this (static compiled shapes); 0 = off
    context_parallel_size: int = 1  # ranks sharing each pass (context_parallel.py)
    fp8: bool = False  # float8 GEMMs: every rank's share of a pass is a multiple of 16 tokens

    @property
    def pass_multiple(self) -> int:
        """Passes are padded to a multiple of this (0: not padded): the compiled shapes' multiple, and
        2 x cp tokens so that a pass splits into the context-parallel chunks (16 x cp with fp8)."""
        cp = self.context_parallel_size
        split = 16 * cp if self.fp8 else 2 * cp if cp > 1 else 0
        if not split or not self.pass_pad_multiple:
            return split or self.pass_pad_multiple
        return math.lcm(split, self.pass_pad_multiple)

    @classmethod
    def from_settings(
        cls, settings: TrainerSettings, pad_token_id: int, on_cuda: bool = True, compiled: bool = False
    ) -> StepSettings:
        """Rows are merged only on CUDA: there the attention is FlexAttention (cost ~ the tokens of each
        sample), while the CPU path builds a dense [T, T] mask per pass. Passes are padded to static
        lengths only for compiled layers (eager kernels take any length at no cost)."""
        forward = settings.forward
        uses_ratio = settings.loss.use_ppo_clip or settings.loss.algorithm in RATIO_ALGORITHMS
        return cls(
            temperature=forward.temperature,
            chunk_size=forward.entropy_chunk_size,
            grad_clip=settings.optimizer.grad_clip,
            batch_ref_logprobs=forward.ppo_clip_ref_logprobs == "batch" and uses_ratio,
            pad_token_id=pad_token_id,
            pad_to_multiple_of=min(forward.pad_to_multiple_of, 64),
            max_tokens_per_forward=forward.trainer_max_tokens_per_forward if on_cuda else 0,
            pass_pad_multiple=forward.trainer_pass_pad_multiple if compiled else 0,
            context_parallel_size=settings.fsdp_context_parallel_size,
            fp8=settings.fp8,
        )


@dataclass
class StepOutcome:
    stats: LossStats
    loss: torch.Tensor  # step objective: sum over minibatches of loss_g * normalizer_g / step normalizer
    grad_norms: list[float] = field(default_factory=list)
    skipped_updates: int = 0
    rows: int = 0
    noop_rows: int = 0
    tokens: int = 0  # tokens run through the model on this rank, padding included


def to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    move = {
        name: getattr(mb, name).to(device, non_blocking=True)
        for name in (
            "input_ids",
            "position_ids",
            "document_ids",
            "cu_seqlens",
            "loss_mask",
            "advantages",
            "rollout_logprobs",
        )
    }
    return replace(mb, **move)


def group_minibatches(
    rows: list[MicroBatch], settings: StepSettings, device: torch.device
) -> list[list[MicroBatch]]:
    """Forward passes per minibatch (rows merged up to ``max_tokens_per_forward``, on the device),
    with the same number of minibatches and passes per minibatch on every rank."""
    local = max((mb.minibatch for mb in rows), default=-1) + 1
    num = int(all_reduce_(torch.tensor([local], device=device), dist.ReduceOp.MAX).item())
    groups: list[list[MicroBatch]] = [[] for _ in range(num)]
    for mb in rows:
        groups[mb.minibatch].append(mb)
    groups = [
        [
            to_device(pad_row(mb, settings.pass_multiple, settings.pad_token_id), device)
            for mb in merge_rows(group, settings.max_tokens_per_forward)
        ]
        for group in groups
    ]
    counts = all_reduce_(torch.tensor([len(g) for g in groups], device=device), dist.ReduceOp.MAX).tolist()
    normalizers = all_reduce_(
        torch.tensor(
            [g[0].loss_normalizer if g else 0.0 for g in groups], dtype=torch.float64, device=device
        ),
        dist.ReduceOp.MAX,
    ).tolist()
    for g, (group, count) in enumerate(zip(groups, counts, strict=True)):
        while len(group) < count:  # a rank without work still joins the collectives (loss exactly 0)
            group.append(
                to_device(
                    pad_row(
                        build_micro_batch(
                            [], settings.pad_to_multiple_of, settings.pad_token_id, g, normalizers[g]
                        ),
                        settings.pass_multiple,
                        settings.pad_token_id,
                    ),
                    device,
                )
            )
    return groups


@torch.no_grad()
def reference_logprobs(
    model: PolicyModel, groups: list[list[MicroBatch]], settings: StepSettings, timer: StepTimer
) -> list[list[torch.Tensor]]:
    """Pre-update log-probs of every row (the ratio reference with ``ppo_clip_ref_logprobs: batch``)."""
    out = []
    for g, group in enumerate(groups):
        refs = []
        for i, mb in enumerate(group):
            with timer.span("ref_logprobs", minibatch=g, microbatch=i):
                logprobs, _ = model(mb, settings.temperature, settings.chunk_size)
            refs.append(logprobs)
        out.append(refs)
    # FSDP2 leaves the root unsharded after a forward (it expects a backward next): reshard, so that
    # model.parameters() is the sharded set again and the memory is released.
    model.reshard()
    return out


def run_step(
    model: PolicyModel,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    rows: list[MicroBatch],
    loss_settings: LossSettings,
    settings: StepSettings,
    timer: StepTimer,
    device: torch.device,
) -> StepOutcome:
    """Minibatch loop of one training step (module docstring). Call on every rank."""
    with timer.span("data_to_device"):
        groups = group_minibatches(rows, settings, device)
    refs = reference_logprobs(model, groups, settings, timer) if settings.batch_ref_logprobs else None
    outcome = StepOutcome(
        stats=LossStats.zeros(device), loss=torch.zeros((), dtype=torch.float64, device=device)
    )
    params = [p for group in optimizer.param_groups for p in group["params"]]  # the sharded parameters
    context = model.context
    for g, group in enumerate(groups):
        if not group:
            continue
        with timer.span("zero_grad", minibatch=g):
            optimizer.zero_grad(set_to_none=True)
        for i, mb in enumerate(group):
            model.set_requires_gradient_sync(i == len(group) - 1)
            with timer.span("forward", minibatch=g, microbatch=i):
                logprobs, entropy = model(mb, settings.temperature, settings.chunk_size)
            with timer.span("loss_computation", minibatch=g, microbatch=i):
                out = policy_loss(
                    logprobs,
                    mb.rollout_logprobs,
                    mb.advantages,
                    mb.loss_mask,
                    mb.document_ids,
                    loss_settings,
                    mb.loss_normalizer,
                    entropy=entropy,
                    ref_logprobs=None if refs is None else refs[g][i],
                )
            with timer.span("backward", minibatch=g, microbatch=i):
                out.loss.backward()
            outcome.tokens += mb.num_tokens // context.size  # the tokens this rank ran
            if not context.is_lead:  # its CP group's lead counted the same row
                continue
            outcome.stats = outcome.stats + out.stats
            outcome.loss += out.stats.values[0] * (mb.loss_normalizer / max(batch.loss_normalizer, 1e-12))
            outcome.rows += 1
            outcome.noop_rows += int(mb.is_noop)
        with timer.span("grad_norm", minibatch=g):
            norm = clip_gradients(params, settings.grad_clip)
        outcome.grad_norms.append(norm)
        with timer.span("optimizer", minibatch=g):
            if math.isfinite(norm):
                optimizer.step()
                after_optimizer_step(model)  # fp8: the updated weights' float8 scales (one all-reduce)
            else:  # a NaN/inf gradient would poison AdamW's moments: skip the update, keep going
                outcome.skipped_updates += 1
    optimizer.zero_grad(set_to_none=True)  # free gradient memory between steps
    return outcome


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Total (pre-clip) gradient L2 norm over all ranks; clips in place when ``max_norm > 0``.

    FSDP2 gradients are DTensors sharded on dim 0 of a 1-D mesh: every element lives on exactly one
    rank, so the norm is computed on the local shards (one foreach kernel per dtype) and the squared
    partial norms are summed with one all-reduce, instead of going through DTensor dispatch, whose
    host time per parameter is what the GPU waits for.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if not all(_sharded_on_one_mesh(g, grads[0]) for g in grads):
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if hasattr(norm, "full_tensor"):  # DTensor: the partial norms are reduced over the mesh
            norm = norm.full_tensor()
        if max_norm > 0 and torch.isfinite(norm):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return float(norm)
    with torch.no_grad():
        local = [g.to_local() for g in grads]
        squared = torch.nn.utils.get_total_norm(local, norm_type=2.0).float() ** 2
        mesh = grads[0].device_mesh
        if mesh.size() > 1:
            # offloaded gradients live on the host; the mesh's backend (NCCL) reduces device tensors
            squared = squared.to(mesh.device_type)
            dist.all_reduce(squared, group=mesh.get_group())
        norm = squared.sqrt()
        if max_norm > 0 and torch.isfinite(norm):
            # as clip_grads_with_norm_: scale by max_norm / (norm + 1e-6) when that is below 1
            torch._foreach_mul_(local, torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(local[0].device))
    return float(norm)


def _sharded_on_one_mesh(grad: torch.Tensor, first: torch.Tensor) -> bool:
    placements = getattr(grad, "placements", None)
    return (
        placements is not None
        and grad.device_mesh == first.device_mesh
        and grad.device_mesh.ndim == 1
        and all(pl.is_shard() for pl in placements)
    )


def step_metrics(outcome: StepOutcome, loss_settings: LossSettings, device: torch.device) -> dict[str, float]:
    """Reference step metrics (token-weighted over micro-batches and ranks) plus trainer/... extras."""
    counters = torch.tensor(
        [outcome.loss.item(), outcome.rows, outcome.noop_rows, outcome.tokens],
        dtype=torch.float64,
        device=device,
    )
    all_reduce_(outcome.stats.values)
    all_reduce_(counters)
    metrics = loss_metrics(outcome.stats, loss_settings)
    loss, rows, noop, tokens = counters.tolist()
    metrics["loss"] = loss
    metrics["trainer/batch/trainable_tokens"] = metrics.pop("num_tokens")
    metrics["trainer/batch/micro_batches"] = rows - noop
    metrics["trainer/batch/noop_micro_batches"] = noop
    metrics["trainer/batch/tokens"] = tokens
    norms = outcome.grad_norms
    metrics["grad_norm"] = sum(norms) / len(norms) if norms else 0.0
    metrics["trainer/optimizer/skipped_updates"] = float(outcome.skipped_updates)
    return metrics


class StepLoop:
    """``train_step`` as both trainers run it around their own ``_run_step(batch, timer)``: the batch
    checked against the data-parallel size, peak memory and the timeline reset, the LR schedule
    stepped after the update, the step's metrics. A trainer provides ``dp_size``, ``rank``,
    ``device``, ``info``, ``settings``, ``timeline_attrs``, ``model``, ``scheduler``,
    ``loss_settings``, ``learning_rate``, ``skipped_updates`` and ``_step``."""

    def _run_step(self, batch: TrainBatch, timer: StepTimer) -> StepOutcome:
        raise NotImplementedError

    def train_step(self, batch: TrainBatch) -> StepResult:
        """One step on this rank's replica's micro-batches; every rank calls it with the same batch."""
        if len(batch.micro_batches) != self.dp_size:
            raise ValueError(
                f"TrainBatch for step {batch.step} has micro-batches for {len(batch.micro_batches)} "
                f"ranks; the trainer has {self.dp_size} data-parallel replicas (pack with "
                f"num_dp_ranks={self.dp_size})"
            )
        if self.info.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        timer = StepTimer(
            self.device,
            attrs={"step": batch.step, "rank": self.rank, **self.timeline_attrs},
            detail=self.settings.track_gpu_events,
        )
        lr = self.learning_rate
        wall = time.perf_counter()
        self.model.train()
        with timer.span("step", always=True):
            outcome = self._run_step(batch, timer)
            with warnings.catch_warnings():  # a skipped (non-finite) first update is not a misuse
                warnings.filterwarnings(
                    "ignore", message="Detected call of `lr_scheduler.step", category=UserWarning
                )
                self.scheduler.step()
        metrics = step_metrics(outcome, self.loss_settings, self.device)
        events, timings = timer.finish()
        elapsed = time.perf_counter() - wall
        self.skipped_updates += outcome.skipped_updates
        self._step += 1
        metrics.update(timings)
        metrics.update(
            {
                "learning_rate": lr,
                "timing_step_active": timings.get("timing_step_total", elapsed),
                "timing_microbatch_count": float(outcome.rows),
                "trainer/optimizer/skipped_updates_total": float(self.skipped_updates),
                "trainer/throughput/tokens_per_s": metrics["trainer/batch/tokens"] / max(elapsed, 1e-9),
            }
        )
        if self.info.is_cuda:
            metrics["trainer/memory/peak_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return StepResult(step=batch.step, metrics=metrics, timeline=events)
