"""The Megatron trainer's CPU offload on a CUDA GPU (``-m gpu``): offloading half of the parameters,
their copies on a side stream from pinned memory (``megatron_overlap_cpu_optimizer_d2h_h2d``), steps
as the run without offload to float32 rounding (the host runs torch's CPU AdamW kernel where the device
runs its CUDA one); float32 compute, so only the optimizer's kernels differ.

    python -m pytest tests/megatron_backend/test_optimizer_gpu.py -m gpu -q
"""

from __future__ import annotations

import pytest
import torch

from ._models import build
from ._trainer_runs import batches, exported, settings

pytestmark = pytest.mark.gpu
COMPARED = ("loss", "entropy", "kl_divergence_inference")


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    owned = not dist.is_initialized()
    yield
    if owned and dist.is_initialized():
        dist.destroy_process_group()


def _run(root, **keys) -> dict:
    from refractor.megatron import parallel
    from refractor.megatron.trainer import MegatronTrainer

    keys = dict(mixed_precision_dtype=None, **keys)
    trainer = MegatronTrainer(settings(build("qwen2"), "megatron", root, **keys), device="cuda")
    try:
        metrics = [trainer.train_step(batch).metrics for batch in batches(1)]
        optimizer = trainer.optimizer
        return {
            "metrics": metrics,
            "export": {name: t.cpu() for name, t in exported(trainer).items()},
            "host": [optimizer.stepped[name] for name in optimizer.offloaded],
            "side_stream": optimizer.host is not None and optimizer.host.stream is not None,
        }
    finally:
        parallel.stop()


def test_offload_over_a_side_stream_steps_as_without_offload(world, tmp_path):
    plain = _run(tmp_path / "plain")
    offload = _run(
        tmp_path / "offload", megatron_optimizer_cpu_offload=True, megatron_optimizer_offload_fraction=0.5
    )
    assert offload["side_stream"] and offload["host"]
    assert all(host.is_pinned() and host.grad.is_pinned() for host in offload["host"])
    for got, want in zip(offload["metrics"], plain["metrics"], strict=True):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    for name, tensor in plain["export"].items():  # four updates at lr 1e-3 (test_trainer's bound)
        torch.testing.assert_close(offload["export"][name], tensor, rtol=0, atol=5e-5, msg=name)
