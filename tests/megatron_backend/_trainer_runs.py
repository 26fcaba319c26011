"""The runs the Megatron trainer tests compare: one rank in the test's process, and a 4-process gloo
world (spawned once) that runs several layouts one after the other in the same processes."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from refractor.trainer.settings import TrainerSettings

from ._cpu_forward import quiet_megatron
from ._models import build

VOCAB = 500  # sample token ids stay below the tiny models' vocabularies (600 and 512)
KEYS = dict(
    learning_rate=1e-3,
    weight_decay=0.01,
    lr_scheduler="cosine",
    warmup_steps=1,
    number_of_steps=4,
    pad_to_multiple_of=16,
    entropy_chunk_size=48,
    temperature=0.8,
    use_ppo_clip=True,  # the ratio against the pre-update log-probs of the step (a no-grad pass first)
    ppo_clip_ref_logprobs="batch",
    activation_checkpointing=False,
)
# (name, model, TP, PP, distributed optimizer): each runs on 4 ranks, data parallelism takes the rest.
# Qwen2 is tied with a padded vocabulary; Qwen3 untied, with q/k norms (replicated over TP, their
# gradients summed over it).
LAYOUTS = [
    ("tp2-pp2", "qwen2", 2, 2, True),
    ("tp2-dp2", "qwen3-untied", 2, 1, True),
    ("pp2-dp2", "qwen2", 1, 2, False),
]
ARCHS = ("qwen2", "qwen3-untied")


def settings(model, backend: str, checkpoint_dir, **keys) -> TrainerSettings:
    return TrainerSettings.from_keys(
        model=str(model), train_backend=backend, checkpoint_dir=str(checkpoint_dir), **KEYS, **keys
    )


def batches(dp: int):
    """Three steps of 7 samples; the second has two minibatches (two AdamW updates)."""
    from trainer._helpers import make_samples, pack

    return [
        pack(
            make_samples(n=7, seed=20 + i, vocab=VOCAB),
            num_dp_ranks=dp,
            step=i,
            number_of_minibatches=1 + (i == 1),
        )
        for i in range(3)
    ]


def exported(trainer, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Rank 0's export ({} on the other ranks, which take part)."""
    return {
        name: t.clone()
        for bucket in trainer.export_weight_buckets(bucket_mb=1, dtype=dtype)
        for name, t in bucket
    }


def run_three_steps(trainer, dp: int) -> dict:
    """Three steps with a checkpoint after the second: what an uninterrupted run produces."""
    steps = batches(dp)
    metrics = [trainer.train_step(steps[0]).metrics, trainer.train_step(steps[1]).metrics]
    trainer.save_checkpoint()
    metrics.append(trainer.train_step(steps[2]).metrics)
    return {"metrics": metrics, "export": exported(trainer)}


def local_shards(trainer) -> list[list[dict[str, torch.Tensor]]] | None:
    """Every rank's own parameters, gathered on rank 0 as ``[stage][tp_rank]`` of the first replica."""
    ranks = trainer.ranks
    mine = (
        ranks.data_rank,
        ranks.pipeline_rank,
        ranks.tensor_rank,
        {n: p.detach().clone() for n, p in trainer.params.items()},
    )
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return None
    shards = [[None] * ranks.tensor_size for _ in range(ranks.pipeline_size)]
    for dp, stage, tp, state in everyone:
        if dp == 0:
            shards[stage][tp] = state
    return shards


def four_rank_worker(rank: int, port: int, root: str) -> None:
    from refractor.megatron import parallel
    from refractor.megatron.trainer import MegatronTrainer
    from refractor.trainer.distributed import init_distributed

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)
    quiet_megatron()
    init_distributed(rank, 4, master_port=port)
    for name, arch, tp, pp, distributed in LAYOUTS:
        keys = dict(
            megatron_tensor_parallel_size=tp,
            megatron_pipeline_parallel_size=pp,
            megatron_use_distributed_optimizer=distributed,
        )
        layout_settings = settings(build(arch), "megatron", f"{root}/{name}", **keys)
        dp = 4 // (tp * pp)
        trainer = MegatronTrainer(layout_settings)
        result = run_three_steps(trainer, dp)
        result["bf16_export"] = exported(trainer, torch.bfloat16)
        result["shards"] = local_shards(trainer)
        parallel.stop()
        resumed = MegatronTrainer(layout_settings)
        assert resumed.load_checkpoint("latest") == 2
        result["resumed_export_before"] = exported(resumed)
        result["resumed_metrics"] = resumed.train_step(batches(dp)[2]).metrics
        result["resumed_export"] = exported(resumed)
        parallel.stop()
        if rank == 0:
            torch.save(result, f"{root}/{name}.pt")
    dist.destroy_process_group()
