"""The context-parallel runs ``test_context_parallel`` compares with one rank: a 4-process gloo world
(spawned once) that runs the CP layouts one after the other in the same processes."""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.distributed as dist

from refractor.trainer.settings import MegatronSettings

from ._cpu_forward import quiet_megatron
from ._models import build
from ._trainer_runs import batches, exported, settings

# (name, model, TP, PP, sequence parallelism, trainer_max_tokens_per_forward): CP = 2 on 4 ranks, data
# parallelism takes the rest. Qwen3 (untied, q/k norms summed over TP) under TP; Qwen2 (tied: its
# embedding and head on two stages sum their gradients) under PP; the CP x DP layout splits AdamW's
# state among the replicas; "passes" concatenates a minibatch's rows into passes as a GPU rank does
# (samples of several rows and padding in the middle of a pass share its split).
LAYOUTS = [
    ("cp2-tp2", "qwen3-untied", 2, 1, False, 0),
    ("cp2-pp2", "qwen2", 1, 2, False, 0),
    ("cp2-dp2", "qwen2", 1, 1, False, 0),
    ("cp2-tp2-sp", "qwen3-untied", 2, 1, True, 0),
    ("cp2-pp2-passes", "qwen2", 1, 2, False, 4096),
]
STEPS = 2  # the second step has two minibatches: three AdamW updates
RESUMED = "cp2-dp2"  # saved after its steps, then resumed without CP (DP=4)


def pass_lengths(trainer, max_tokens: int) -> list[int]:
    """Tokens of each pass this rank's replica runs in the ``STEPS`` steps (before padding)."""
    from refractor.trainer.rows import merge_rows

    lengths = []
    for batch in batches(trainer.dp_size)[:STEPS]:
        rows = batch.micro_batches[trainer.dp_rank]
        for minibatch in sorted({mb.minibatch for mb in rows}):
            group = [mb for mb in rows if mb.minibatch == minibatch]
            lengths += [mb.num_tokens for mb in merge_rows(group, max_tokens)]
    return lengths


def run_steps(trainer, dp: int) -> dict:
    """``STEPS`` steps' metrics and the exported weights after them."""
    metrics = [trainer.train_step(batch).metrics for batch in batches(dp)[:STEPS]]
    return {"metrics": metrics, "export": exported(trainer)}


def resume_without_context_parallelism(trainer, layout_settings) -> dict:
    """Save ``trainer``'s checkpoint and run the next step on it; then a trainer without CP (the 4 ranks
    as 4 replicas) resumes from the checkpoint and runs the same step."""
    from refractor.megatron import parallel
    from refractor.megatron.trainer import MegatronTrainer

    trainer.save_checkpoint()
    after = trainer.train_step(batches(trainer.dp_size)[STEPS]).metrics
    export = exported(trainer)
    parallel.stop()
    resumed = MegatronTrainer(replace(layout_settings, megatron=MegatronSettings()))
    assert resumed.load_checkpoint("latest") == STEPS
    return {
        "step": after,
        "export": export,
        "resumed_step": resumed.train_step(batches(resumed.dp_size)[STEPS]).metrics,
        "resumed_export": exported(resumed),
        "resumed_dp": resumed.dp_size,
    }


def four_rank_worker(rank: int, port: int, root: str) -> None:
    from refractor.megatron import parallel
    from refractor.megatron.trainer import MegatronTrainer
    from refractor.trainer.distributed import init_distributed

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)
    quiet_megatron()
    init_distributed(rank, 4, master_port=port)
    for name, arch, tp, pp, sequence_parallel, max_tokens in LAYOUTS:
        layout_settings = settings(
            build(arch),
            "megatron",
            f"{root}/{name}",
            megatron_tensor_parallel_size=tp,
            megatron_pipeline_parallel_size=pp,
            megatron_context_parallel_size=2,
            megatron_sequence_parallel=sequence_parallel,
        )
        trainer = MegatronTrainer(layout_settings)
        trainer.step_settings = replace(trainer.step_settings, max_tokens_per_forward=max_tokens)
        # the tokens the first layer's core attention sees as queries, pass by pass
        queries: list[int] = []
        hook = trainer.model.decoder.layers[0].self_attention.core_attention.register_forward_pre_hook(
            lambda _, args, queries=queries: queries.append(args[0].shape[0])
        )
        result = run_steps(trainer, trainer.dp_size)
        hook.remove()
        result["queries"] = queries
        result["rows"] = pass_lengths(trainer, max_tokens)
        if name == RESUMED:
            result["resume"] = resume_without_context_parallelism(trainer, layout_settings)
        parallel.stop()
        if rank == 0:
            torch.save(result, f"{root}/{name}.pt")
    dist.destroy_process_group()
