"""Context parallelism in the Megatron trainer (CPU, gloo, float32): ranks sharing each row train as one
rank holding it.

On 4 processes (spawned once for the module) CP=2 runs with TP=2, with PP=2 (also with a minibatch's
rows concatenated into passes, as on a GPU), with DP=2 (AdamW state split among the replicas) and with
TP=2 under sequence parallelism; each layout's steps (loss, gradient
norm, statistics) and its exported weights after three AdamW updates equal one rank's, and each rank's
layers saw half of every pass's tokens as queries. A CP=2 x DP=2 checkpoint resumes as DP=4. The split
itself, the mask and the log-prob gather are the FSDP trainer's (``tests/trainer/test_context_parallel.py``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ._context_parallel_runs import LAYOUTS, RESUMED, STEPS, four_rank_worker, run_steps
from ._cpu_forward import MEGATRON_WARNINGS, free_port, gloo_world, quiet_megatron, spawn_ranks
from ._models import build
from ._trainer_runs import settings

with warnings.catch_warnings():
    quiet_megatron()
    pytest.importorskip(
        "megatron.core", reason="megatron-core is the `megatron` extra (scripts/install.sh --dev)"
    )
pytestmark = [pytest.mark.filterwarnings(f"ignore:.*{text}.*:UserWarning") for text in MEGATRON_WARNINGS]
COMPARED = ("loss", "grad_norm", "entropy", "kl_divergence_inference", "learning_rate")
ARCHS = sorted({arch for _, arch, *_ in LAYOUTS})


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Per model: ``STEPS`` steps of the Megatron trainer on one rank."""

    from refractor.megatron import parallel
    from refractor.megatron.trainer import MegatronTrainer

    tmp = tmp_path_factory.mktemp("one-rank")
    runs = {}
    with gloo_world():
        for arch in ARCHS:
            runs[arch] = run_steps(MegatronTrainer(settings(build(arch), "megatron", tmp / arch)), 1)
            parallel.stop()
    return runs


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("context-parallel")
    for arch in ARCHS:  # built once, before the ranks read them
        build(arch)
    spawn_ranks(four_rank_worker, (free_port(), str(root)), nprocs=4)
    return {name: torch.load(root / f"{name}.pt", weights_only=False) for name, *_ in LAYOUTS}


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS])
def test_context_parallel_layouts_equal_one_rank(four_ranks, one_rank, layout):
    """Tolerance: float32 sums in another order (the attention over gathered keys, the CP x DP gradient
    sum) -> rel 1e-5 on the loss and the statistics, 1e-4 on the norm; the weights after three AdamW
    updates at lr 1e-3 within 1e-5 (1% of one update)."""
    _, arch, tp, pp, *_ = next(entry for entry in LAYOUTS if entry[0] == layout)
    result, reference = four_ranks[layout], one_rank[arch]
    assert len(result["metrics"]) == STEPS
    for step, (got, want) in enumerate(zip(result["metrics"], reference["metrics"], strict=True)):
        for key in COMPARED:
            rel = 1e-4 if key == "grad_norm" else 1e-5
            assert got[key] == pytest.approx(want[key], rel=rel, abs=1e-7), (step, key)
        for key in ("trainer/batch/trainable_tokens", "trainer/optimizer/skipped_updates"):
            assert got[key] == want[key], (step, key)
        if tp * pp * 2 == 4:  # one replica: the same rows, counted once over the CP ranks
            assert got["trainer/batch/tokens"] == want["trainer/batch/tokens"], step
    assert result["export"].keys() == reference["export"].keys()
    for name, tensor in reference["export"].items():
        torch.testing.assert_close(result["export"][name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS])
def test_each_context_parallel_rank_attends_half_of_every_pass(four_ranks, layout):
    """Rank 0's first layer: its core attention's queries are half of each pass's tokens (passes
    padded to a multiple of 2 x CP; under sequence parallelism the TP blocks gathered back to them),
    once per pass in the no-grad reference pass, the forward and the recompute."""
    result = four_ranks[layout]
    queries, passes = result["queries"], result["rows"]
    assert queries and set(queries) == {(n + (-n) % 4) // 2 for n in passes}
    if layout.endswith("-passes"):  # one pass per minibatch: 3 minibatches, 3 passes of each kind
        assert len(passes) == 3 and len(queries) == 3 * 3


def test_a_checkpoint_saved_under_context_parallelism_resumes_without_it(four_ranks):
    """CP changes no shard (the AdamW state is per TP x PP shard): a CP=2 x DP=2 checkpoint resumes on
    the same 4 ranks as DP=4, and its next step equals the CP run's next step (the rows packed for 4
    replicas: float32 sums in another order)."""
    resume = four_ranks[RESUMED]["resume"]
    assert resume["resumed_dp"] == 4
    for key in COMPARED:
        rel = 1e-4 if key == "grad_norm" else 1e-5
        assert resume["resumed_step"][key] == pytest.approx(resume["step"][key], rel=rel, abs=1e-7), key
    for name, tensor in resume["export"].items():
        torch.testing.assert_close(resume["resumed_export"][name], tensor, rtol=0, atol=1e-5, msg=name)
