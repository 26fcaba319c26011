"""``MegatronTrainer`` on a mixture-of-experts model (Qwen3-MoE, CPU, gloo, float32): on 2 processes with
data parallelism 2, the experts on every rank (EP=1) and split between the two (EP=2, each rank
holding 2 of the 4 experts of every layer, tokens all-gathered to the experts and their outputs
reduce-scattered back) give the steps of one rank: the same loss, gradient norm and metrics, and after
three steps (two minibatches in the second) the same exported HF weights; the EP=2 checkpoint resumes
exactly. (``test_moe`` holds one rank's forward and gradients to HF's.)"""

from __future__ import annotations

import warnings

import pytest
import torch

from ._cpu_forward import MEGATRON_WARNINGS, free_port, quiet_megatron, spawn_ranks
from ._models import build
from ._moe_runs import MOE_LAYOUTS, two_rank_moe_worker
from ._trainer_runs import run_three_steps, settings

with warnings.catch_warnings():
    quiet_megatron()
    pytest.importorskip(
        "megatron.core", reason="megatron-core is the `megatron` extra (scripts/install.sh --dev)"
    )
pytestmark = [pytest.mark.filterwarnings(f"ignore:.*{text}.*:UserWarning") for text in MEGATRON_WARNINGS]
COMPARED = ("loss", "grad_norm", "entropy", "kl_divergence_inference", "learning_rate")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One rank's three steps (in this process), then the 2-process layouts."""
    import torch.distributed as dist

    from refractor.megatron import parallel
    from refractor.megatron.trainer import MegatronTrainer

    tmp = tmp_path_factory.mktemp("moe")
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    one = run_three_steps(MegatronTrainer(settings(build("qwen3-moe"), "megatron", tmp / "one")), 1)
    parallel.stop()
    if owned:
        dist.destroy_process_group()
    spawn_ranks(two_rank_moe_worker, (free_port(), str(tmp)), nprocs=2)
    return one, {name: torch.load(tmp / f"{name}.pt") for name, _, _ in MOE_LAYOUTS}


def _assert_same_steps(got: list[dict], expected: list[dict]) -> None:
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        for key in COMPARED:
            assert g[key] == pytest.approx(e[key], rel=1e-5, abs=1e-6), (step, key)


@pytest.mark.parametrize("name", [name for name, _, _ in MOE_LAYOUTS])
def test_expert_parallel_steps_equal_one_rank(runs, name):
    one, layouts = runs
    run = layouts[name]
    ep = dict((n, e) for n, _, e in MOE_LAYOUTS)[name]
    assert run["experts"] == 4 // ep
    _assert_same_steps(run["metrics"], one["metrics"])
    assert run["export"].keys() == one["export"].keys()
    for key, tensor in one["export"].items():
        torch.testing.assert_close(run["export"][key], tensor, rtol=1e-5, atol=1e-5, msg=key)


def test_an_expert_parallel_checkpoint_resumes_exactly(runs):
    _, layouts = runs
    run = layouts["qwen3-moe-dp2-ep2"]
    _assert_same_steps([run["resumed_metrics"]], run["metrics"][2:])
    for key, tensor in run["export"].items():
        torch.testing.assert_close(run["resumed_export"][key], tensor, rtol=1e-6, atol=1e-6, msg=key)
