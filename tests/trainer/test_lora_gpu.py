"""LoRA on a GPU (GPU only): the frozen base in bf16 next to fp32 adapters in the same FSDP2 units
(compiled layers, the default checkpointing), adapters move and the base does not, the merged
export equals W + scale B A of the trained parameters, and bf16 steps follow the fp32 CPU-exact
path's losses closely.

    python -m pytest tests/trainer/test_lora_gpu.py -m gpu -q
"""

from __future__ import annotations

import pytest
import torch

from ._helpers import full_params, make_samples, make_settings, pack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

RANK, ALPHA = 8, 16.0


def _run(model_path, precision: str) -> dict:
    from refractor.trainer import Trainer

    settings = make_settings(
        model_path,
        lora_rank=RANK,
        lora_alpha=ALPHA,
        learning_rate=1e-2,
        mixed_precision_dtype=precision,
        model_dtype="float32",
    )
    trainer = Trainer(settings, device=torch.device("cuda"))
    dtypes = {n: p.dtype for n, p in trainer.model.named_parameters()}
    initial = full_params(trainer)
    metrics = [trainer.train_step(pack(make_samples(n=6, seed=70 + i), step=i)).metrics for i in range(3)]
    export = {n: t.float().cpu() for b in trainer.export_weight_buckets(1, torch.float32) for n, t in b}
    return {
        "dtypes": dtypes,
        "initial": initial,
        "params": full_params(trainer),
        "metrics": metrics,
        "export": export,
    }


def test_lora_trains_adapters_on_a_bf16_base_and_exports_merged_weights(tiny_qwen2_path):
    bf16 = _run(tiny_qwen2_path, "bfloat16")
    fp32 = _run(tiny_qwen2_path, "float32")
    adapters = {n for n in bf16["dtypes"] if ".lora_" in n}
    assert adapters and all(bf16["dtypes"][n] == torch.float32 for n in adapters)
    assert all(d == torch.bfloat16 for n, d in bf16["dtypes"].items() if n not in adapters)  # no fp32 base
    for name, p in bf16["params"].items():
        if ".lora_" not in name:
            assert torch.equal(p, bf16["initial"][name]), name
    assert any(
        not torch.equal(bf16["params"][n], bf16["initial"][n]) for n in bf16["params"] if ".lora_B" in n
    )
    scale = ALPHA / RANK
    for name, t in bf16["export"].items():
        stem = name.removesuffix(".weight")
        if f"{stem}.lora_A.weight" in bf16["params"]:
            a, b = bf16["params"][f"{stem}.lora_A.weight"], bf16["params"][f"{stem}.lora_B.weight"]
            want = bf16["params"][name].double() + scale * b.double() @ a.double()
            torch.testing.assert_close(t.double(), want, rtol=0, atol=2e-2, msg=name)  # bf16 export
    for got, want in zip(bf16["metrics"], fp32["metrics"], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=5e-2, abs=5e-3)
