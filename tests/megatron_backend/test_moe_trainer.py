"""``MegatronTrainer`` on mixture-of-experts models (CPU, gloo, float32), on 4 processes:

* the tied Qwen3-MoE as PP=2 x DP=2, and as TP=2 x DP=2 with sequence parallelism (each TP rank routes
  its block of the sequence, every expert split over TP), its experts split over EP=2;
* Mixtral as DP=4 with its experts on every rank (EP=1) and split over EP=2 (each expert on 2 ranks);

give the steps of one rank: the same loss, gradient norm and metrics, and after three steps (two
minibatches in the second) the same exported HF weights (gathered over the EP ranks, and from the
second stage); each layout's checkpoint resumes exactly. Mixtral's EP=2 layout in bf16 (bf16 tokens
gathered to the experts, their outputs summed in float32) stays within 2e-2 of the float32 steps.
Tokens reach the experts of other ranks through the all-gather dispatcher (``moe_layer.py``).
(``test_moe`` holds one rank's forward and gradients to HF's.)"""

from __future__ import annotations

import warnings

import pytest
import torch

from refractor.models.loading import iter_safetensors

from ._cpu_forward import MEGATRON_WARNINGS, free_port, gloo_world, quiet_megatron, spawn_ranks
from ._models import build
from ._moe_runs import BF16_MOE_LAYOUT, MOE_LAYOUTS, four_rank_moe_worker
from ._trainer_runs import batches, exported, run_three_steps, settings

with warnings.catch_warnings():
    quiet_megatron()
    pytest.importorskip(
        "megatron.core", reason="megatron-core is the `megatron` extra (scripts/install.sh --dev)"
    )
pytestmark = [pytest.mark.filterwarnings(f"ignore:.*{text}.*:UserWarning") for text in MEGATRON_WARNINGS]
COMPARED = ("loss", "grad_norm", "entropy", "kl_divergence_inference", "learning_rate")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One rank's three steps per model (in this process), then the 4-process layouts."""

    from refractor.megatron import parallel
    from refractor.megatron.trainer import MegatronTrainer

    tmp = tmp_path_factory.mktemp("moe")
    one = {}
    with gloo_world():
        for arch in ("qwen3-moe", "mixtral"):
            one[arch] = run_three_steps(MegatronTrainer(settings(build(arch), "megatron", tmp / arch)), 1)
            parallel.stop()
    spawn_ranks(four_rank_moe_worker, (free_port(), str(tmp)), nprocs=4)
    names = [name for name, *_ in MOE_LAYOUTS] + [BF16_MOE_LAYOUT[0]]
    return one, {name: torch.load(tmp / f"{name}.pt") for name in names}


def _assert_same_steps(got: list[dict], expected: list[dict]) -> None:
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        for key in COMPARED:
            assert g[key] == pytest.approx(e[key], rel=1e-5, abs=1e-6), (step, key)


@pytest.mark.parametrize("name, arch, ep", [(name, arch, ep) for name, arch, _, _, ep, _ in MOE_LAYOUTS])
def test_expert_parallel_steps_equal_one_rank(runs, name, arch, ep):
    one, layouts = runs
    run = layouts[name]
    assert run["experts"] == 4 // ep
    # the export is named as the checkpoint is (the experts one by one, as save_pretrained writes them)
    assert run["export"].keys() == {name for name, _ in iter_safetensors(build(arch))}
    _assert_same_steps(run["metrics"], one[arch]["metrics"])
    assert run["export"].keys() == one[arch]["export"].keys()
    for key, tensor in one[arch]["export"].items():
        torch.testing.assert_close(run["export"][key], tensor, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("name", [name for name, *_ in MOE_LAYOUTS])
def test_an_expert_parallel_checkpoint_resumes_exactly(runs, name):
    run = runs[1][name]
    _assert_same_steps([run["resumed_metrics"]], run["metrics"][2:])
    for key, tensor in run["export"].items():
        torch.testing.assert_close(run["resumed_export"][key], tensor, rtol=1e-6, atol=1e-6, msg=key)


def test_expert_parallel_bf16_steps_stay_near_the_float32_steps(runs):
    one, layouts = runs
    name, arch, *_ = BF16_MOE_LAYOUT
    low = layouts[name]
    assert low["dtypes"] == {torch.bfloat16, torch.float32}  # bf16 model, float32 masters
    for step, (got, want) in enumerate(zip(low["metrics"], one[arch]["metrics"], strict=True)):
        for key in ("loss", "grad_norm", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=2e-2), (step, key)
    assert low["metrics"][0]["grad_norm"] != one[arch]["metrics"][0]["grad_norm"]  # it ran in bf16


@pytest.mark.gpu
def test_on_cuda_moe_bf16_steps_stay_near_float32_and_export_every_expert(tmp_path):
    """One CUDA rank, Mixtral: the trainer's CUDA defaults (bf16 compute, rows concatenated into passes)
    against the same steps in float32 on the GPU; the export holds every expert under its checkpoint
    name."""
    import torch.distributed as dist

    from refractor.megatron import parallel
    from refractor.megatron.trainer import MegatronTrainer

    path = build("mixtral")
    runs = {}
    for name, dtype in (("bf16", "bfloat16"), ("fp32", None)):
        trainer = MegatronTrainer(settings(path, "megatron", tmp_path / name, mixed_precision_dtype=dtype))
        assert trainer.device.type == "cuda"
        assert trainer.compute_dtype == (torch.bfloat16 if dtype else torch.float32)
        runs[name] = {
            "metrics": [trainer.train_step(batch).metrics for batch in batches(1)],
            "export": exported(trainer),
        }
        parallel.stop()
    dist.destroy_process_group()
    for low, high in zip(runs["bf16"]["metrics"], runs["fp32"]["metrics"], strict=True):
        for key in ("loss", "grad_norm", "entropy"):
            assert low[key] == pytest.approx(high[key], rel=2e-2), key
    assert runs["bf16"]["export"].keys() == {name for name, _ in iter_safetensors(path)}
