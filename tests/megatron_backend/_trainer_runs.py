"""The runs the Megatron trainer tests compare: one rank in the test's process, and a 4-process gloo
world (spawned once) that runs several layouts one after the other in the same processes, then the
TP=2 x PP=2 layout in bf16 and the vocabulary-parallel head over the 4 ranks as one group."""

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


def batches(dp: int, pad_to: int | None = None):
    """Three steps of 7 samples; the second has two minibatches (two AdamW updates). ``pad_to``: rows
    padded to this multiple (None: the helpers' 16; 1: rows of any length, odd ones included)."""
    from refractor.algorithms.packing import pack_train_batch
    from trainer._helpers import PAD_TO, SEQ_LEN, make_samples

    return [
        pack_train_batch(
            make_samples(n=7, seed=20 + i, vocab=VOCAB),
            step=i,
            seq_len=SEQ_LEN,
            pad_to_multiple_of=pad_to or PAD_TO,
            pad_token_id=0,
            num_dp_ranks=dp,
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


def assert_resumes_exactly(resumed, run: dict, compared: tuple[str, ...]) -> None:
    """``resumed`` (a one-rank trainer built as ``run``'s was) loads the checkpoint saved after step 2:
    its third step's metrics (``compared``) and exported weights equal the uninterrupted run's exactly."""
    from refractor.megatron import parallel

    try:
        assert resumed.load_checkpoint("latest") == 2
        metrics = resumed.train_step(batches(1)[2]).metrics
        after = exported(resumed)
    finally:
        parallel.stop()
    for key in compared:
        assert metrics[key] == run["metrics"][2][key], key
    for name, tensor in run["export"].items():
        assert torch.equal(after[name], tensor), name


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
    for name, arch, tp, pp, pad_to in SP_LAYOUTS:
        trainer = MegatronTrainer(
            settings(
                build(arch),
                "megatron",
                f"{root}/{name}",
                megatron_tensor_parallel_size=tp,
                megatron_pipeline_parallel_size=pp,
                megatron_sequence_parallel=True,
            )
        )
        # the tokens the first layer's norm and its attention see, pass by pass
        layer = trainer.model.decoder.layers[0]
        seen = {"norm": [], "attention": []}
        hooks = [
            layer.input_layernorm.register_forward_pre_hook(
                lambda _, a, seen=seen: seen["norm"].append(a[0].shape[0])
            ),
            layer.self_attention.core_attention.register_forward_pre_hook(
                lambda _, a, seen=seen: seen["attention"].append(a[0].shape[0])
            ),
        ]
        steps = batches(4 // (tp * pp), pad_to)
        result = {
            "metrics": [trainer.train_step(batch).metrics for batch in steps],
            "export": exported(trainer),
            "rows": [mb.num_tokens for batch in steps for mb in batch.micro_batches[trainer.dp_rank]],
            "seen": seen,
        }
        for hook in hooks:
            hook.remove()
        parallel.stop()
        if rank == 0:
            torch.save(result, f"{root}/{name}.pt")
    low = MegatronTrainer(
        settings(
            build(BF16_LAYOUT[1]),
            "megatron",
            f"{root}/{BF16_LAYOUT[0]}",
            megatron_tensor_parallel_size=BF16_LAYOUT[2],
            megatron_pipeline_parallel_size=BF16_LAYOUT[3],
            mixed_precision_dtype="bfloat16",
        ),
        mixed_precision=True,
    )
    result = {"metrics": [low.train_step(batch).metrics for batch in batches(1)], "sent": low.stage.dtype}
    parallel.stop()
    blocks = vocabulary_blocks(rank)
    if rank == 0:
        torch.save(result, f"{root}/{BF16_LAYOUT[0]}.pt")
        torch.save(blocks, f"{root}/vocabulary-blocks.pt")
    dist.destroy_process_group()


BF16_LAYOUT = ("tp2-pp2-bf16", "qwen2", 2, 2)
# (name, model, TP, PP, rows padded to): sequence parallelism, compared with the same layout without it
# (LAYOUTS, rows padded to 16) and with one rank; rows of any length (1) make passes of odd lengths,
# which the trainer pads to a multiple of TP
SP_LAYOUTS = [
    ("tp2-pp2-sp", "qwen2", 2, 2, None),
    ("tp2-dp2-sp", "qwen3-untied", 2, 1, 1),
]
VOCABULARY, BLOCK, HIDDEN = 10, 4, 5  # blocks of rows [0, 4), [4, 8), [8, 10) and none on the 4th rank


def vocabulary_blocks(rank: int) -> dict | None:
    """The vocabulary-parallel head (float64) on 4 ranks, rank r holding rows [4r, 4r + 4) of a 10-token
    head (the last rank none, as a rank whose block of a padded vocabulary is all padding): the
    per-token log-probs and entropies, the hidden states' gradient summed over the ranks and the
    gathered weight gradient of ``loss = sum(a * logprobs + b * entropy)``, on rank 0 (None elsewhere)."""
    from refractor.megatron.vocab_parallel import vocab_parallel_token_logprobs

    inputs = vocabulary_inputs()
    start = min(rank * BLOCK, VOCABULARY)
    block = inputs["weight"][start : start + BLOCK].clone().requires_grad_(True)
    hidden = inputs["hidden"].clone().requires_grad_(True)
    logprobs, entropy = vocab_parallel_token_logprobs(
        hidden, block, start, inputs["input_ids"], dist.group.WORLD, temperature=0.8, chunk_size=3
    )
    (inputs["a"] * logprobs + inputs["b"] * entropy).sum().backward()
    grad_hidden = hidden.grad.clone()
    dist.all_reduce(grad_hidden)
    blocks = [None] * dist.get_world_size()
    dist.all_gather_object(blocks, block.grad)
    if rank != 0:
        return None
    return {"logprobs": logprobs, "entropy": entropy, "grad_hidden": grad_hidden, "grad_weight": blocks}


def vocabulary_inputs() -> dict[str, torch.Tensor]:
    """The head, a row's hidden states and tokens, and the loss weights of ``vocabulary_blocks``."""
    g = torch.Generator().manual_seed(3)
    return {
        "weight": torch.randn(VOCABULARY, HIDDEN, generator=g, dtype=torch.float64),
        "hidden": torch.randn(8, HIDDEN, generator=g, dtype=torch.float64),
        "input_ids": torch.randint(0, VOCABULARY, (8,), generator=g),
        "a": torch.randn(8, generator=g, dtype=torch.float64),
        "b": torch.randn(8, generator=g, dtype=torch.float64),
    }
