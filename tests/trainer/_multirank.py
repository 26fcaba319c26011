"""Body of the 2-rank test, run in processes spawned by test_multirank.py (gloo on CPU)."""

from __future__ import annotations

from dataclasses import replace

import torch

from refractor.trainer import Trainer
from refractor.weight_sync.gather import iter_weight_buckets

from ._helpers import full_params, make_samples, make_settings, pack, quiet_env

BUCKET_BYTES = 128 * 1024


def schedule_settings(model_path, checkpoint_dir):
    return make_settings(
        model_path,
        checkpoint_dir=checkpoint_dir,
        lr_scheduler="cosine",
        warmup_steps=1,
        number_of_steps=4,
        weight_decay=0.01,
    )


def batches(world_size: int):
    # 7 samples: the first step's rows do not split evenly over 2 ranks (a no-op row is exercised).
    return [pack(make_samples(n=7, seed=20 + i), num_dp_ranks=world_size, step=i) for i in range(3)]


def run_reference(trainer: Trainer, world_size: int) -> dict:
    """Three steps, a checkpoint after the second: what an uninterrupted run produces."""
    bs = batches(world_size)
    metrics = [trainer.train_step(bs[0]).metrics]
    params_step1 = full_params(trainer)
    metrics.append(trainer.train_step(bs[1]).metrics)
    trainer.save_checkpoint()
    metrics.append(trainer.train_step(bs[2]).metrics)
    return {"metrics": metrics, "params_step1": params_step1, "params": full_params(trainer)}


def known_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Full gradients every rank can rebuild (seeded), large enough that grad_clip=1 scales them."""
    g = torch.Generator().manual_seed(5)
    return {name: torch.randn(p.shape, generator=g) for name, p in trainer.model.named_parameters()}


def clip_known_gradients(trainer: Trainer, max_norm: float = 1.0) -> dict:
    """Sets the gradients to ``known_gradients`` (sharded like the parameters), clips, returns the
    reported norm and the full clipped gradients."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from refractor.trainer.step import clip_gradients

    full = known_gradients(trainer)
    params = dict(trainer.model.named_parameters())
    for name, p in params.items():
        p.grad = (
            distribute_tensor(full[name], p.device_mesh, p.placements)
            if isinstance(p, DTensor)
            else full[name].clone()
        )
    norm = clip_gradients(list(params.values()), max_norm)
    grads = {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for name, p in params.items()
    }
    trainer.optimizer.zero_grad(set_to_none=True)
    return {"norm": norm, "grads": grads, "reference": full}


def worker(rank: int, world_size: int, port: int, model_path: str, checkpoint_dir: str, out: str) -> None:
    quiet_env()
    settings = schedule_settings(model_path, checkpoint_dir)
    trainer = Trainer(settings, rank, world_size, master_port=port)
    result = run_reference(trainer, world_size)
    buckets = list(iter_weight_buckets(trainer.model, BUCKET_BYTES, torch.float32))
    result["bucket_names"] = [[name for name, _ in b] for b in buckets]
    result["buckets"] = {name: t.cpu() for b in buckets for name, t in b}

    result["clip"] = clip_known_gradients(trainer)

    resumed = Trainer(settings, rank, world_size)  # same process group
    assert resumed.load_checkpoint("latest") == 2
    result["resumed_metrics"] = resumed.train_step(batches(world_size)[2]).metrics
    result["resumed_params"] = full_params(resumed)
    torch.save(result, f"{out}.rank{rank}")
    resumed.shutdown()


def offload_worker(
    rank: int, world_size: int, port: int, model_path: str, checkpoint_dir: str, out: str
) -> None:
    """The same three steps with ``fsdp_cpu_offload``: state in host memory, the export gathered on
    the training device, a checkpoint saved and loaded back."""
    quiet_env()
    settings = replace(schedule_settings(model_path, checkpoint_dir), fsdp_cpu_offload=True)
    trainer = Trainer(settings, rank, world_size, master_port=port)
    result = run_reference(trainer, world_size)
    result["buckets"] = {
        name: t.cpu()
        for b in iter_weight_buckets(trainer.model, BUCKET_BYTES, torch.float32)
        for name, t in b
    }
    resumed = Trainer(settings, rank, world_size)
    assert resumed.load_checkpoint("latest") == 2
    resumed.train_step(batches(world_size)[2])
    result["resumed_params"] = full_params(resumed)
    torch.save(result, f"{out}.rank{rank}")
    resumed.shutdown()
