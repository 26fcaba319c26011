"""The CUDA path (NCCL, bf16 mixed precision, FlexAttention): one step against the fp32 HF reference."""

from __future__ import annotations

import pytest
import torch

from refractor.trainer import Trainer

from ._helpers import full_params, make_samples, make_settings, pack
from .test_train_step import hf_reference

pytestmark = pytest.mark.gpu


def test_cuda_bf16_step_matches_the_fp32_reference_and_exports(tiny_qwen2_path):
    samples = make_samples()
    settings = make_settings(tiny_qwen2_path)  # model_dtype float32 master weights, bf16 compute
    trainer = Trainer(settings)
    assert trainer.device.type == "cuda" and trainer.compute_dtype == torch.bfloat16
    m = trainer.train_step(pack(samples)).metrics
    ref = hf_reference(tiny_qwen2_path, samples, settings.forward.temperature)
    assert m["loss"] == pytest.approx(ref["loss"], rel=3e-2, abs=3e-3)
    assert m["entropy"] == pytest.approx(ref["entropy"], rel=1e-2)
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=5e-2)
    assert m["trainer/memory/peak_allocated_gb"] > 0
    params = full_params(trainer)
    got = {n: t for bucket in trainer.export_weight_buckets(1, torch.bfloat16) for n, t in bucket}
    assert list(got) == list(params)
    for name, t in got.items():
        assert t.is_cuda and torch.equal(t.cpu(), params[name].to(torch.bfloat16)), name
