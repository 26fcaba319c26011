"""Megatron-Core's parallel state on the trainer's process group, and this rank's place in it.

``start(sizes, device)`` builds Megatron-Core's groups over the default process group (already
joined: NCCL on CUDA, gloo on CPU) in its default order: tensor-parallel ranks adjacent, then
context-parallel, then data-parallel, then pipeline stages. The context-parallel ranks of a replica
share its rows (``refractor.trainer.context_parallel``): they hold the same parameters and sum their
gradients with the data-parallel replicas'. A mixture-of-experts model's experts are shared among the
``expert`` ranks of each TP rank's data-parallel ranks (EP ranks adjacent), each expert replicated on
the ranks of its expert-data-parallel group. The RNG tracker that megatron-core's dropout and
initialization fork is its inference tracker, which forks nothing: every dropout of the models built
here is 0 and their weights are loaded, so there is no random state to track (the default tracker is
CUDA-only and refuses a fork before a model-parallel seed is set).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from refractor.megatron.layout import ParallelSizes
from refractor.trainer.context_parallel import ContextGroup

# megatron-core's warnings about the fallbacks this path takes on purpose (torch norms and kernels in
# place of Apex / Transformer Engine ones) and about CUDA tuning: they say nothing about a run here
FALLBACK_WARNINGS = (
    "Apex is not installed",
    "Transformer Engine and Apex are not installed",
    "full scope is deprecated",
    "CUDA_DEVICE_MAX_CONNECTIONS",
)


def quiet_fallback_warnings() -> None:
    """Leave megatron-core's ``FALLBACK_WARNINGS`` out of this process's output (trainer logs)."""
    for text in FALLBACK_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{text}.*", category=UserWarning)


@dataclass(frozen=True)
class MegatronRanks:
    """This rank's coordinates in the TP x CP x DP x PP grid (and EP within DP), its groups and its
    device."""

    tensor_rank: int
    tensor_size: int
    pipeline_rank: int
    pipeline_size: int
    data_rank: int
    data_size: int
    tensor_group: dist.ProcessGroup
    data_group: dist.ProcessGroup
    context: ContextGroup  # the CP ranks sharing this rank's rows (a group of one without CP)
    gradient_group: dist.ProcessGroup  # the DP x CP ranks holding the same parameters: they sum gradients
    model_group: dist.ProcessGroup  # the TP x PP ranks of one model replica
    # global ranks of the stages' ranks with this rank's TP, CP and DP coordinates, stage by stage
    stage_ranks: tuple[int, ...]
    # the first and the last stage's ranks of this coordinate (a tied embedding lives on both);
    # None on a middle stage and with one stage
    embedding_group: dist.ProcessGroup | None
    expert_rank: int
    expert_size: int
    expert_group: dist.ProcessGroup  # the EP ranks that share one copy of the experts
    expert_data_rank: int
    expert_data_group: dist.ProcessGroup  # the ranks that hold this rank's experts (their replicas)
    device: torch.device

    @property
    def is_first_stage(self) -> bool:
        return self.pipeline_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pipeline_rank == self.pipeline_size - 1

    @property
    def previous_stage(self) -> int:
        return self.stage_ranks[self.pipeline_rank - 1]

    @property
    def next_stage(self) -> int:
        return self.stage_ranks[self.pipeline_rank + 1]

    @property
    def is_lead(self) -> bool:
        """The one rank of its replica that counts the loss: the last stage's first TP and CP rank."""
        return self.is_last_stage and self.tensor_rank == 0 and self.context.is_lead

    @property
    def is_first_replica(self) -> bool:
        """A rank of the first replica and its first CP rank: the ranks whose shards are exported and
        saved (one copy of the weights)."""
        return self.data_rank == 0 and self.context.rank == 0


def start(sizes: ParallelSizes, device: torch.device) -> MegatronRanks:
    """Megatron-Core's parallel state for ``sizes`` over the default process group."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tensor,
        pipeline_model_parallel_size=sizes.pipeline,
        context_parallel_size=sizes.context,
        expert_model_parallel_size=sizes.expert,
        create_gloo_process_groups=False,
    )
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    stages = sizes.pipeline
    return MegatronRanks(
        tensor_rank=ps.get_tensor_model_parallel_rank(),
        tensor_size=sizes.tensor,
        pipeline_rank=ps.get_pipeline_model_parallel_rank(),
        pipeline_size=stages,
        data_rank=ps.get_data_parallel_rank(),
        data_size=ps.get_data_parallel_world_size(),
        tensor_group=ps.get_tensor_model_parallel_group(),
        data_group=ps.get_data_parallel_group(),
        context=ContextGroup(
            sizes.context,
            ps.get_context_parallel_rank(),
            ps.get_context_parallel_group() if sizes.context > 1 else None,
        ),
        gradient_group=ps.get_data_parallel_group(with_context_parallel=True),
        model_group=ps.get_model_parallel_group(),
        stage_ranks=tuple(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())),
        embedding_group=ps.get_embedding_group(check_initialized=False) if stages > 1 else None,
        expert_rank=ps.get_expert_model_parallel_rank(),
        expert_size=sizes.expert,
        expert_group=ps.get_expert_model_parallel_group(),
        expert_data_rank=ps.get_expert_data_parallel_rank(),
        expert_data_group=ps.get_expert_data_parallel_group(),
        device=device,
    )


def stop() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.destroy_model_parallel()
    tensor_parallel.random.initialize_rng_tracker(force_reset=True)
