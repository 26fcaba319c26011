"""The expert-parallel runs of the Megatron trainer tests: a 2-process gloo world that trains a
mixture-of-experts model with its experts on every rank (EP=1) and split between the two (EP=2), both
with data parallelism 2, then resumes the EP=2 run from its checkpoint."""

from __future__ import annotations

import os

import torch

from ._cpu_forward import quiet_megatron
from ._models import build
from ._trainer_runs import batches, exported, run_three_steps, settings

MOE_LAYOUTS = [("qwen3-moe-dp2", "qwen3-moe", 1), ("qwen3-moe-dp2-ep2", "qwen3-moe", 2)]


def two_rank_moe_worker(rank: int, port: int, root: str) -> None:
    import torch.distributed as dist

    from refractor.megatron import parallel
    from refractor.megatron.trainer import MegatronTrainer
    from refractor.trainer.distributed import init_distributed

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)
    quiet_megatron()
    init_distributed(rank, 2, master_port=port)
    for name, arch, ep in MOE_LAYOUTS:
        layout_settings = settings(
            build(arch), "megatron", f"{root}/{name}", megatron_expert_parallel_size=ep
        )
        trainer = MegatronTrainer(layout_settings)
        result = run_three_steps(trainer, 2)
        result["experts"] = len(trainer.model.decoder.layers[0].mlp.experts.local_experts)
        parallel.stop()
        resumed = MegatronTrainer(layout_settings)
        assert resumed.load_checkpoint("latest") == 2
        result["resumed_metrics"] = resumed.train_step(batches(2)[2]).metrics
        result["resumed_export"] = exported(resumed)
        parallel.stop()
        if rank == 0:
            torch.save(result, f"{root}/{name}.pt")
    dist.destroy_process_group()
