"""One training step of the Megatron trainer on one rank: the FSDP trainer's step (``trainer/step.py``)
with the model split by tensor and pipeline parallelism and each row by context parallelism.

1. Rows are grouped into minibatches as the FSDP step groups them (``group_minibatches``; on CUDA a
   minibatch's rows are concatenated into passes of ``trainer_max_tokens_per_forward`` tokens): every
   rank of a replica holds the same rows (its data-parallel rank's micro-batches), and ranks agree on
   the count of minibatches and rows. With context parallelism a pass is padded to a multiple of
   2 x CP tokens and each CP rank runs its share of it (``forward.py``).
2. ``ppo_clip_ref_logprobs: batch``: a no-grad pass stores the pre-update log-probs on the last stage.
3. Per minibatch: each row runs forward through the stages (activations sent stage to stage), the
   last stage computes the log-probs on its vocabulary-parallel head and the shared loss
   (``policy_loss``; with CP, on the whole row gathered from the CP ranks, identically on each, as the
   FSDP trainer's CP computes it: the loss has per-sample terms), and the backward runs back through
   the stages (gradients sent the other way) before the next row starts. Megatron-Core's own pipeline
   schedules allocate their buffers on CUDA devices; this schedule runs wherever torch does, one row in
   flight at a time.
4. Gradients are finalized: a tied head's copy on the last stage and the first stage's embedding sum
   their gradients; data-parallel replicas and CP ranks sum theirs (the loss is normalized by the global
   token count, so gradients add up; a CP rank's gradient is that of its own tokens' log-probs), an
   expert's over the ranks that hold it (its expert-data-parallel group: each EP rank's expert already
   has the gradient of every token its EP group routed to it). The norm counts every element once
   (tensor-parallel duplicates, the replicated norms, and the tied copy are left out of the sum; each
   EP rank's experts are counted), is clipped as the FSDP step clips, and AdamW steps unless the norm
   is not finite (counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from refractor.algorithms.loss import LossSettings, LossStats, policy_loss
from refractor.megatron.forward import row_logprobs, stage_forward
from refractor.megatron.optimizer import MegatronOptimizer
from refractor.megatron.parallel import MegatronRanks
from refractor.megatron.sequence_parallel import SEQUENCE_SUMMED
from refractor.megatron.shards import is_tensor_parallel
from refractor.records import MicroBatch, TrainBatch
from refractor.trainer.context_parallel import RowShard
from refractor.trainer.step import StepOutcome, StepSettings, group_minibatches
from refractor.trainer.timing import StepTimer

QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")


@dataclass(frozen=True)
class StageModel:
    """This rank's part of the model and what its step needs beside it."""

    model: torch.nn.Module
    ranks: MegatronRanks
    vocab_size: int
    hidden_size: int
    dtype: torch.dtype  # of the activations sent between stages
    tied_copy: torch.nn.Parameter | None  # the tied embedding this rank holds when it lives on two stages
    norm_params: tuple[torch.nn.Parameter, ...]  # the gradients this rank counts in the norm
    tensor_summed: tuple[torch.nn.Parameter, ...]  # replicated, each TP rank's gradient a share
    sequence_parallel: bool = False  # activations between the layers split along the sequence over TP
    grad_reduce_dtype: torch.dtype | None = None  # the data-parallel sum's dtype when not the gradients'
    experts: tuple[torch.nn.Parameter, ...] = ()  # this EP rank's experts (MoE), apart from the rest

    def stage_tokens(self, mb: MicroBatch) -> int:
        """Tokens of the row that this rank's stages send each other."""
        tokens = mb.num_tokens // self.ranks.context.size
        return tokens // self.ranks.tensor_size if self.sequence_parallel else tokens

    def row_shard(self, mb: MicroBatch) -> RowShard | None:
        """This CP rank's share of the row (None without context parallelism)."""
        context = self.ranks.context
        return context.shard(mb.document_ids) if context.enabled else None

    def forward_row(
        self, mb: MicroBatch, grad: bool, shard: RowShard | None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the activations received from the previous stage or None, this stage's output); a stage
        before the last sends its output on."""
        ranks = self.ranks
        received = None
        if not ranks.is_first_stage:
            received = torch.empty(
                self.stage_tokens(mb), 1, self.hidden_size, dtype=self.dtype, device=ranks.device
            )
            dist.recv(received, src=ranks.previous_stage)
            received.requires_grad_(grad)
        sequence_group = ranks.tensor_group if self.sequence_parallel else None
        out = stage_forward(self.model, mb, received, sequence_group, shard)
        if not ranks.is_last_stage:
            dist.send(out.detach().contiguous(), dst=ranks.next_stage)
        return received, out

    def backward_row(
        self, out: torch.Tensor, received: torch.Tensor | None, loss: torch.Tensor | None
    ) -> None:
        """The row's backward on this stage: from the loss on the last stage, from the gradient the
        next stage sends otherwise; the gradient of the received activations goes back."""
        ranks = self.ranks
        if ranks.is_last_stage:
            loss.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=ranks.next_stage)
            out.backward(grad)
        if received is not None:
            dist.send(received.grad.contiguous(), dst=ranks.previous_stage)

    def logprobs(self, out: torch.Tensor, mb: MicroBatch, settings: StepSettings, shard: RowShard | None):
        return row_logprobs(
            self.model,
            out,
            mb,
            self.vocab_size,
            self.ranks,
            settings.temperature,
            settings.chunk_size,
            sequence_parallel=self.sequence_parallel,
            shard=shard,
        )


@torch.no_grad()
def reference_logprobs(
    stage: StageModel, groups: list[list[MicroBatch]], settings: StepSettings, timer: StepTimer
) -> list[list[torch.Tensor | None]]:
    """Pre-update log-probs of every row on the last stage (None elsewhere)."""
    out = []
    for g, group in enumerate(groups):
        refs = []
        for i, mb in enumerate(group):
            with timer.span("ref_logprobs", minibatch=g, microbatch=i):
                shard = stage.row_shard(mb)
                _, hidden = stage.forward_row(mb, False, shard)
                last = stage.ranks.is_last_stage
                refs.append(stage.logprobs(hidden, mb, settings, shard)[0] if last else None)
        out.append(refs)
    return out


def run_step(
    stage: StageModel,
    optimizer: MegatronOptimizer,
    params: list[torch.nn.Parameter],
    batch: TrainBatch,
    rows: list[MicroBatch],
    loss_settings: LossSettings,
    settings: StepSettings,
    timer: StepTimer,
) -> StepOutcome:
    """Minibatch loop of one training step (module docstring). Call on every rank."""
    ranks = stage.ranks
    device = ranks.device
    with timer.span("data_to_device"):
        groups = group_minibatches(rows, settings, device)
    refs = reference_logprobs(stage, groups, settings, timer) if settings.batch_ref_logprobs else None
    outcome = StepOutcome(
        stats=LossStats.zeros(device), loss=torch.zeros((), dtype=torch.float64, device=device)
    )
    for g, group in enumerate(groups):
        with timer.span("zero_grad", minibatch=g):
            optimizer.zero_grad()
        for i, mb in enumerate(group):
            with timer.span("forward", minibatch=g, microbatch=i):
                shard = stage.row_shard(mb)
                received, out = stage.forward_row(mb, True, shard)
                if ranks.is_last_stage:
                    logprobs, entropy = stage.logprobs(out, mb, settings, shard)
            loss = None
            if ranks.is_last_stage:
                with timer.span("loss_computation", minibatch=g, microbatch=i):
                    result = policy_loss(
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
                loss = result.loss
            with timer.span("backward", minibatch=g, microbatch=i):
                stage.backward_row(out, received, loss)
            if not ranks.is_lead:  # the replica's lead counts each row once (CP ranks share it)
                continue
            outcome.stats = outcome.stats + result.stats
            outcome.loss += result.stats.values[0] * (mb.loss_normalizer / max(batch.loss_normalizer, 1e-12))
            outcome.rows += 1
            outcome.noop_rows += int(mb.is_noop)
            outcome.tokens += mb.num_tokens
        with timer.span("grad_norm", minibatch=g):
            finalize_gradients(stage, params)
            norm = clip_gradients(stage, params, settings.grad_clip)
        outcome.grad_norms.append(norm)
        with timer.span("optimizer", minibatch=g):
            if math.isfinite(norm):
                optimizer.step()
            else:  # a NaN/inf gradient would poison AdamW's moments: skip the update, keep going
                outcome.skipped_updates += 1
    optimizer.zero_grad()
    return outcome


def finalize_gradients(stage: StageModel, params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients that are shares: the q/k norms' over the TP ranks (each normalizes its own
    heads with the one weight), with sequence parallelism the other norms' (each normalizes its own
    tokens), the tied embedding's two copies (first and last stage), and the data-parallel replicas'
    and CP ranks' (each computed its own tokens' share)."""
    ranks = stage.ranks
    for p in params:
        if p.grad is None:  # a parameter the rows did not reach still joins the sums
            p.grad = torch.zeros_like(p)
    if ranks.tensor_size > 1 and stage.tensor_summed:
        _sum_grads(stage.tensor_summed, ranks.tensor_group)
    if stage.tied_copy is not None:
        dist.all_reduce(stage.tied_copy.grad, group=ranks.embedding_group)
    experts = {id(p) for p in stage.experts}
    shared = [p for p in params if id(p) not in experts]
    if ranks.data_size * ranks.context.size > 1 and shared:
        _sum_grads(shared, ranks.gradient_group, stage.grad_reduce_dtype)
    if stage.experts and dist.get_world_size(ranks.expert_data_group) > 1:
        _sum_grads(stage.experts, ranks.expert_data_group, stage.grad_reduce_dtype)


def _sum_grads(params, group: dist.ProcessGroup, dtype: torch.dtype | None = None) -> None:
    """All-reduce (sum) the gradients of ``params`` over ``group`` in one flat buffer (in ``dtype``,
    rounded back into the gradients, when given)."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if dtype is not None:
        flat = flat.to(dtype)
    dist.all_reduce(flat, group=group)
    torch._foreach_copy_(
        grads,
        [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)],
    )


def tensor_summed_parameters(
    params: dict[str, torch.nn.Parameter], sequence_parallel: bool = False
) -> tuple[torch.nn.Parameter, ...]:
    """Replicated parameters whose gradient each TP rank holds a share of: the q/k norms (Qwen3),
    applied to every head, of which each rank holds its own (Megatron-Core sums them likewise); with
    sequence parallelism also the norms applied to each rank's block of the sequence
    (``sequence_parallel.SEQUENCE_SUMMED``)."""
    summed = QK_NORMS + (SEQUENCE_SUMMED if sequence_parallel else ())
    return tuple(p for name, p in params.items() if name.endswith(summed))


def norm_parameters(
    params: dict[str, torch.nn.Parameter], ranks: MegatronRanks, tied_copy: torch.nn.Parameter | None
) -> tuple[torch.nn.Parameter, ...]:
    """The parameters whose gradients this rank counts in the norm, so that the model's every element
    is counted once: tensor-parallel shards, replicated tensors on the first TP rank; a tied head's copy
    on the last stage is not counted (the first stage's embedding is)."""
    return tuple(
        p
        for name, p in params.items()
        if (is_tensor_parallel(name) or ranks.tensor_rank == 0)
        and not (p is tied_copy and ranks.is_last_stage)
    )


def _squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of squares of ``grads``, each tensor's norm accumulated in float32 whatever its dtype."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)) ** 2


def clip_gradients(stage: StageModel, params: list[torch.nn.Parameter], max_norm: float) -> float:
    """The model's total (pre-clip) gradient L2 norm, every element counted once; clips in place
    when ``max_norm > 0`` (scale ``max_norm / (norm + 1e-6)`` when below 1, as the FSDP step)."""
    grads = [p.grad for p in params]
    experts = {id(p) for p in stage.experts}
    counted = [p.grad for p in stage.norm_params if id(p) not in experts]
    counted_experts = [p.grad for p in stage.norm_params if id(p) in experts]
    with torch.no_grad():
        squared = _squared_norm(counted, stage.ranks.device)
        if stage.experts:  # each EP rank holds other experts
            squared_experts = _squared_norm(counted_experts, stage.ranks.device)
            if stage.ranks.expert_size > 1:
                dist.all_reduce(squared_experts, group=stage.ranks.expert_group)
            squared = squared + squared_experts
        if dist.get_world_size(stage.ranks.model_group) > 1:
            dist.all_reduce(squared, group=stage.ranks.model_group)
        norm = squared.sqrt()
        if max_norm > 0 and torch.isfinite(norm):
            torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return float(norm)
