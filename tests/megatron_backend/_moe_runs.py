"""The expert-parallel runs of the Megatron trainer tests: a 4-process gloo world that trains each
mixture-of-experts layout in ``MOE_LAYOUTS`` three steps (a checkpoint after the second), then resumes
it from that checkpoint; then ``BF16_MOE_LAYOUT`` in bf16."""

from __future__ import annotations

import os

import torch

from ._cpu_forward import quiet_megatron
from ._models import build
from ._trainer_runs import batches, exported, run_three_steps, settings

# (name, model, TP, PP, EP, CP) on 4 ranks, data parallelism the rest: the tied Qwen3-MoE over two stages
# (its embedding on both) with each EP rank holding 2 of the 4 experts, and as TP 2 (with sequence
# parallelism: each TP rank routes its block of the sequence, the experts are split over TP as well);
# Mixtral over 4 data-parallel ranks, each expert on 2 of them (its gradients summed over the pair),
# with the experts on every rank (EP 1) and split (EP 2); Qwen3-MoE with 2 context-parallel ranks sharing
# each row (each routes its own tokens; the experts' gradients summed over the CP and DP ranks)
MOE_LAYOUTS = [
    ("qwen3-moe-pp2-dp2-ep2", "qwen3-moe", 1, 2, 2, 1),
    ("qwen3-moe-tp2-dp2-ep2-sp", "qwen3-moe", 2, 1, 2, 1),
    ("mixtral-dp4", "mixtral", 1, 1, 1, 1),
    ("mixtral-dp4-ep2", "mixtral", 1, 1, 2, 1),
    ("qwen3-moe-cp2-dp2", "qwen3-moe", 1, 1, 1, 2),
]
BF16_MOE_LAYOUT = ("mixtral-dp4-ep2-bf16", "mixtral", 1, 1, 2, 1)


def layout_keys(tp: int, pp: int, ep: int, cp: int = 1) -> dict:
    return dict(
        megatron_tensor_parallel_size=tp,
        megatron_pipeline_parallel_size=pp,
        megatron_expert_parallel_size=ep,
        megatron_context_parallel_size=cp,
        megatron_sequence_parallel=tp > 1,
    )


def four_rank_moe_worker(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist

    from refractor.megatron import parallel
    from refractor.megatron.trainer import MegatronTrainer
    from refractor.trainer.distributed import init_distributed

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)
    quiet_megatron()
    init_distributed(rank, 4, master_port=port)
    for name, arch, tp, pp, ep, cp in MOE_LAYOUTS:
        layout_settings = settings(build(arch), "megatron", f"{root}/{name}", **layout_keys(tp, pp, ep, cp))
        trainer = MegatronTrainer(layout_settings)
        dp = 4 // (tp * pp * cp)
        result = run_three_steps(trainer, dp)
        result["experts"] = len(trainer.model.decoder.layers[0].mlp.experts.local_experts)
        parallel.stop()
        resumed = MegatronTrainer(layout_settings)
        assert resumed.load_checkpoint("latest") == 2
        result["resumed_metrics"] = resumed.train_step(batches(dp)[2]).metrics
        result["resumed_export"] = exported(resumed)
        parallel.stop()
        if rank == 0:
            torch.save(result, f"{root}/{name}.pt")
    name, arch, tp, pp, ep, cp = BF16_MOE_LAYOUT
    keys = layout_keys(tp, pp, ep, cp)
    low = MegatronTrainer(
        settings(build(arch), "megatron", f"{root}/{name}", mixed_precision_dtype="bfloat16", **keys),
        mixed_precision=True,
    )
    result = {
        "metrics": [low.train_step(batch).metrics for batch in batches(4 // (tp * pp))],
        "dtypes": {p.dtype for p in low.model.parameters()} | {p.dtype for p in low.params.values()},
    }
    parallel.stop()
    if rank == 0:
        torch.save(result, f"{root}/{name}.pt")
    dist.destroy_process_group()
