"""``fp8: true`` on an FP8 GPU (H100): the Trainer's compiled float8 steps track the bf16 steps, the
weight scales follow every AdamW update, CPU offload trains the same, and the export is plain.

    python -m pytest tests/trainer/test_fp8_gpu.py -m gpu -q
"""

from __future__ import annotations

import pytest
import torch

from refractor.testing import tiny_qwen2

from ._helpers import make_samples, make_settings, pack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
STEPS = 6


@pytest.fixture(scope="module")
def aligned_model():
    """A random Qwen2 whose projections are all multiples of 16 (every one runs in float8)."""
    pytest.importorskip("torchao.float8")
    from refractor.trainer.fp8 import fp8_supported

    ok, reason = fp8_supported("cuda")
    if not ok:
        pytest.skip(reason)
    return tiny_qwen2(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2)


def _train(path, steps: int = STEPS, **keys):
    from refractor.trainer import Trainer

    trainer = Trainer(make_settings(path, **keys), device=torch.device("cuda"))
    metrics = [trainer.train_step(pack(make_samples(n=12, seed=7), step=i)).metrics for i in range(steps)]
    return trainer, metrics


def test_fp8_steps_track_bf16_and_export_plain_tensors(aligned_model):
    from torchao.float8.float8_linear import Float8Linear

    bf16, reference = _train(aligned_model)
    fp8, metrics = _train(aligned_model, fp8=True)
    assert fp8.compiled and fp8.compute_dtype == torch.bfloat16
    assert isinstance(fp8.model.layers[0].mlp.down_proj, Float8Linear)
    entropy_gaps = [abs(m["entropy"] / r["entropy"] - 1) for m, r in zip(metrics, reference, strict=True)]
    loss_scale = max(abs(r["loss"]) for r in reference)
    loss_gaps = [abs(m["loss"] - r["loss"]) / loss_scale for m, r in zip(metrics, reference, strict=True)]
    print("bf16 losses", [round(r["loss"], 5) for r in reference])
    print("fp8 losses ", [round(m["loss"], 5) for m in metrics])
    print(f"max entropy rel gap {max(entropy_gaps):.2e}, max loss gap / max |loss| {max(loss_gaps):.2e}")
    assert max(entropy_gaps) < 2e-2
    assert max(loss_gaps) < 5e-2
    assert reference[-1]["loss"] < reference[0]["loss"] and metrics[-1]["loss"] < metrics[0]["loss"]

    # the scales were computed from the weights of the last update (step.py calls after_optimizer_step);
    # torchao stores them on the DTensor's own local tensor (to_local() returns a fresh wrapper)
    q_proj = fp8.model.layers[0].self_attn.q_proj.weight._local_tensor
    amax = q_proj._tensor.abs().max().double()
    expected = torch.finfo(torch.float8_e4m3fn).max / amax
    assert q_proj._precomputed_scale.item() == pytest.approx(expected.item(), rel=1e-6)

    names = [n for b in bf16.export_weight_buckets(1, torch.bfloat16) for n, _ in b]
    exported = {n: t for b in fp8.export_weight_buckets(1, torch.bfloat16) for n, t in b}
    assert list(exported) == names
    assert all(type(t) is torch.Tensor and t.dtype == torch.bfloat16 and t.is_cuda for t in exported.values())
    assert torch.equal(exported["model.layers.0.self_attn.q_proj.weight"], q_proj._tensor.to(torch.bfloat16))


def test_fp8_with_cpu_offload_trains_as_without(aligned_model):
    _, on_gpu = _train(aligned_model, steps=2, fp8=True, trainer_compile=False)
    offloaded, metrics = _train(
        aligned_model, steps=2, fp8=True, trainer_compile=False, fsdp_cpu_offload=True
    )
    assert {p.to_local().device.type for p in offloaded.model.parameters()} == {"cpu"}
    print("offload losses", [m["loss"] for m in metrics], "on GPU", [m["loss"] for m in on_gpu])
    assert metrics[0]["loss"] == pytest.approx(on_gpu[0]["loss"], rel=1e-4)  # same weights, same float8 casts
    assert metrics[1]["loss"] == pytest.approx(
        on_gpu[1]["loss"], rel=1e-2
    )  # AdamW on the CPU vs fused on the GPU
