"""``fsdp_cpu_offload`` on a GPU: the state lives in pinned host memory, the GPU holds less, and the
steps, the weight export and the metrics equal those of the same trainer without offload.

    python -m pytest tests/trainer/test_offload_gpu.py -m gpu -q
"""

from __future__ import annotations

import pytest
import torch

from ._helpers import full_params, make_samples, make_settings, pack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _run(model_path, offload: bool) -> dict:
    from refractor.trainer import Trainer

    settings = make_settings(
        model_path, mixed_precision_dtype="float32", trainer_compile=False, fsdp_cpu_offload=offload
    )
    trainer = Trainer(settings, device=torch.device("cuda"))
    torch.cuda.reset_peak_memory_stats()
    metrics = [trainer.train_step(pack(make_samples(n=6, seed=40 + i), step=i)).metrics for i in range(2)]
    out = {
        "metrics": metrics,
        "params": full_params(trainer),
        "peak": torch.cuda.max_memory_allocated(),
        "param_devices": {p.to_local().device.type for p in trainer.model.parameters()},
        "state_devices": {
            v.device.type for state in trainer.optimizer.state.values() for v in state.values() if v.dim()
        },
        "export": {name: t.cpu() for b in trainer.export_weight_buckets(1, torch.float32) for name, t in b},
        "export_devices": {
            t.device.type for b in trainer.export_weight_buckets(1, torch.float32) for _, t in b
        },
    }
    trainer.shutdown()
    return out


def test_offloaded_state_stays_on_the_host_and_the_steps_are_the_same(tiny_qwen2_path):
    plain = _run(tiny_qwen2_path, offload=False)
    off = _run(tiny_qwen2_path, offload=True)
    assert plain["param_devices"] == plain["state_devices"] == {"cuda"}
    assert off["param_devices"] == off["state_devices"] == {"cpu"}
    assert off["export_devices"] == {"cuda"}  # gathered on the training device, as the sender expects
    assert off["peak"] < plain["peak"]
    for got, want in zip(off["metrics"], plain["metrics"], strict=True):
        for key in ("loss", "grad_norm", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    for name, p in plain["params"].items():
        torch.testing.assert_close(off["params"][name], p, rtol=0, atol=1e-5, msg=name)
        assert torch.equal(off["export"][name], off["params"][name]), name
