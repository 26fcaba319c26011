"""``MegatronTrainer`` (CPU, gloo, float32) behind the FSDP trainer's interface.

* On one rank its steps equal the FSDP ``Trainer``'s on the same weights and batches: the same shared
  loss and metrics, the same gradient norm, AdamW updates and learning-rate schedule.
* On 4 processes (spawned once for the module), TP=2 x PP=2, TP=2 x DP=2 (AdamW state split among the
  replicas) and PP=2 x DP=2 equal one rank; the exported HF weights are the ranks' shards merged,
  bit-exact, cast as the FSDP export casts them; a checkpoint resumes exactly (the step after the
  resume equals the step without the stop) and ``refractor convert`` turns it into an HF directory
  that the FSDP trainer also starts from.
* Rows concatenated into longer passes (what a CUDA rank does) give the same steps.
* TP=2 x PP=2 in bf16 (``mixed_precision_dtype``, the stages sending bf16 activations) stays near its
  float32 run (``test_mixed_precision`` holds one rank's bf16 steps to float32 and float64 references).
* The vocabulary-parallel head over 4 ranks, one of them holding no token rows, gives the whole
  softmax's log-probs, entropies and gradients (float64, autograd through ``log_softmax``).

The models are tiny ones of ``_models``: Qwen2, tied, its vocabulary 600 padded to 768 with TP=2 (the
second TP rank's head block holds 216 tokens and 168 padding rows), and Qwen3, untied, with q/k
norms. Megatron-Core's own pipeline schedules and optimizers allocate on CUDA devices; the trainer's
schedule and AdamW run here (``refractor.megatron.step``, ``optimizer``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from refractor.megatron.shards import MegatronLayout, shards_to_hf
from refractor.models import ModelConfig, read_hf_config

from ._cpu_forward import MEGATRON_WARNINGS, free_port, gloo_world, quiet_megatron, spawn_ranks
from ._models import build
from ._trainer_runs import (
    ARCHS,
    BF16_LAYOUT,
    LAYOUTS,
    SP_LAYOUTS,
    batches,
    exported,
    four_rank_worker,
    run_three_steps,
    settings,
    vocabulary_inputs,
)

with warnings.catch_warnings():
    quiet_megatron()
    pytest.importorskip(
        "megatron.core", reason="megatron-core is the `megatron` extra (scripts/install.sh --dev)"
    )
pytestmark = [pytest.mark.filterwarnings(f"ignore:.*{text}.*:UserWarning") for text in MEGATRON_WARNINGS]
COMPARED = ("loss", "grad_norm", "entropy", "kl_divergence_inference", "learning_rate")


def _per_rank(key: str) -> bool:
    return key.startswith(("timing_", "trainer/throughput/", "trainer/memory/"))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """Per model: three steps of the FSDP trainer and of the Megatron trainer on one rank (one gloo
    world for the module)."""

    from refractor.megatron import parallel
    from refractor.megatron.trainer import MegatronTrainer
    from refractor.trainer import Trainer

    tmp = tmp_path_factory.mktemp("one-rank")
    with gloo_world():
        runs = {}
        for arch in ARCHS:
            fsdp_run = run_three_steps(Trainer(settings(build(arch), "fsdp", tmp / arch / "fsdp")), 1)
            megatron = MegatronTrainer(settings(build(arch), "megatron", tmp / arch / "megatron"))
            megatron_run = run_three_steps(megatron, 1)
            parallel.stop()  # the next trainer starts Megatron-Core's parallel state anew
            megatron_run.update(trainer=megatron, checkpoints=tmp / arch / "megatron")
            runs[arch] = {"fsdp": fsdp_run, "megatron": megatron_run}
        yield runs


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("four-ranks")
    for arch in ARCHS:  # built once, before the ranks read them
        build(arch)
    spawn_ranks(four_rank_worker, (free_port(), str(root)), nprocs=4)
    names = [name for name, *_ in LAYOUTS + SP_LAYOUTS] + [BF16_LAYOUT[0], "vocabulary-blocks"]
    results = {name: torch.load(root / f"{name}.pt", weights_only=False) for name in names}
    return {**results, "root": root}


def _layout(name: str) -> tuple[str, int, int]:
    """(model, TP, PP) of the layout ``name``."""
    _, arch, tp, pp, _ = next(entry for entry in LAYOUTS if entry[0] == name)
    return arch, tp, pp


def _assert_same_steps(got: list[dict], want: list[dict], same_rows: bool = True) -> None:
    """Tolerance: float32 sums in another order (fused QKV and gate/up GEMMs, the vocabulary-parallel
    softmax, data-parallel sums) -> rel 1e-5 on the loss and the reported statistics, 1e-4 on the norm.
    ``same_rows``: packed the same way (one data-parallel replica), so the same tokens run."""
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for key in COMPARED:
            rel = 1e-4 if key == "grad_norm" else 1e-5
            assert g[key] == pytest.approx(w[key], rel=rel, abs=1e-7), (step, key)
        for key in ("trainer/batch/trainable_tokens", "trainer/optimizer/skipped_updates"):
            assert g[key] == w[key], (step, key)
        if same_rows:
            assert g["trainer/batch/tokens"] == w["trainer/batch/tokens"], step


def _assert_close_weights(got: dict, want: dict) -> None:
    """After four AdamW updates at lr 1e-3, within 5e-5 (5% of one update's size): AdamW divides by
    sqrt(v) + 1e-8, so where a gradient is tiny (the embedding row of a token seen once) float32
    differences of the gradient move the update by a few percent of the learning rate."""
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=5e-5, msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_rank_steps_equal_the_fsdp_trainer_steps(one_rank, arch):
    fsdp, megatron = one_rank[arch]["fsdp"], one_rank[arch]["megatron"]
    for f, m in zip(fsdp["metrics"], megatron["metrics"], strict=True):
        assert {k for k in f if not _per_rank(k)} == {k for k in m if not _per_rank(k)}  # the same metrics
    _assert_same_steps(megatron["metrics"], fsdp["metrics"])
    assert (
        megatron["metrics"][1]["trainer/batch/micro_batches"]
        == fsdp["metrics"][1]["trainer/batch/micro_batches"]
    )
    _assert_close_weights(megatron["export"], fsdp["export"])


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS])
def test_four_rank_layouts_equal_one_rank(four_ranks, one_rank, layout):
    result = four_ranks[layout]
    arch, tp, pp = _layout(layout)
    reference = one_rank[arch]["megatron"]
    _assert_same_steps(result["metrics"], reference["metrics"], same_rows=tp * pp == 4)
    _assert_close_weights(result["export"], reference["export"])


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS])
def test_the_export_is_the_ranks_shards_merged_bit_exact(four_ranks, layout):
    result = four_ranks[layout]
    arch, tp, pp = _layout(layout)
    config = ModelConfig.from_hf(read_hf_config(build(arch)))
    merged = shards_to_hf(result["shards"], config, MegatronLayout(tensor_parallel=tp, pipeline_parallel=pp))
    assert result["export"].keys() == merged.keys()
    assert ("lm_head.weight" in merged) == (not config.tie_word_embeddings)
    for name, tensor in merged.items():
        assert torch.equal(result["export"][name], tensor), name
        assert torch.equal(result["bf16_export"][name], tensor.to(torch.bfloat16)), name


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS])
def test_a_resumed_step_equals_the_step_without_the_stop(four_ranks, layout):
    result = four_ranks[layout]
    for key in (*COMPARED, "trainer/batch/trainable_tokens"):
        assert result["resumed_metrics"][key] == result["metrics"][2][key], key
    for name, tensor in result["export"].items():
        assert torch.equal(result["resumed_export"][name], tensor), name


def test_rows_concatenated_into_passes_give_the_same_steps(one_rank, tmp_path):
    """On CUDA a minibatch's rows run as passes of up to ``trainer_max_tokens_per_forward`` tokens (the
    attention keeps their samples apart, padding in the middle of a pass included); forced here on CPU."""
    from dataclasses import replace

    from refractor.megatron import parallel
    from refractor.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer(settings(build("qwen2"), "megatron", tmp_path))
    trainer.step_settings = replace(trainer.step_settings, max_tokens_per_forward=4096)
    try:
        metrics = [trainer.train_step(batch).metrics for batch in batches(1)]
    finally:
        parallel.stop()
    rows = one_rank["qwen2"]["megatron"]["metrics"]
    assert [m["trainer/batch/micro_batches"] for m in metrics] == [1, 2, 1]  # one pass per minibatch
    assert all(r["trainer/batch/micro_batches"] > 1 for r in rows)
    _assert_same_steps(metrics, rows)


@pytest.mark.parametrize("layout", [name for name, *_ in SP_LAYOUTS])
def test_sequence_parallelism_gives_the_steps_without_it_and_of_one_rank(four_ranks, one_rank, layout):
    """Sequence parallelism moves where the norms and residual adds run, not what they compute: the
    steps equal the same layout's without it and one rank's (float32 sums in another order, rel 1e-5
    on the loss and the norm). tp2-dp2-sp's rows have odd lengths, padded to a multiple of TP."""
    result = four_ranks[layout]
    without = four_ranks[layout.removesuffix("-sp")]
    arch, tp, pp = _layout(layout.removesuffix("-sp"))
    odd = next(pad_to for name, *_, pad_to in SP_LAYOUTS if name == layout) == 1
    assert any(rows % 2 for rows in result["rows"]) == odd
    for step, (got, want) in enumerate(zip(result["metrics"], without["metrics"], strict=True)):
        for key in ("loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (step, key)
    _assert_same_steps(result["metrics"], one_rank[arch]["megatron"]["metrics"], same_rows=False)
    # the weights exported: the same names and shapes, the values those of the run without it
    _assert_close_weights(result["export"], without["export"])
    # rank 0's first layer: its norm holds half of each pass, its attention the whole (padded) pass
    seen = result["seen"]
    assert seen["norm"] and [2 * n for n in seen["norm"]] == seen["attention"]
    assert set(seen["attention"]) <= {rows + rows % 2 for rows in result["rows"]}


def test_a_bf16_tp2_pp2_run_stays_near_its_float32_run(four_ranks):
    """bf16 rounding moves the steps by ~1e-3 relative (``test_mixed_precision``): 2e-2 is the bound."""
    low, full = four_ranks[BF16_LAYOUT[0]], four_ranks[BF16_LAYOUT[0].removesuffix("-bf16")]
    assert low["sent"] == torch.bfloat16
    for step, (got, want) in enumerate(zip(low["metrics"], full["metrics"], strict=True)):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=2e-2), (step, key)
        assert got["trainer/batch/trainable_tokens"] == want["trainer/batch/trainable_tokens"]
    assert any(g["grad_norm"] != w["grad_norm"] for g, w in zip(low["metrics"], full["metrics"], strict=True))


def test_a_vocabulary_split_in_blocks_one_of_them_empty_gives_the_whole_softmax(four_ranks):
    got = four_ranks["vocabulary-blocks"]
    inputs = vocabulary_inputs()
    weight = inputs["weight"].clone().requires_grad_(True)
    hidden = inputs["hidden"].clone().requires_grad_(True)
    log_probs = torch.log_softmax(hidden[:-1] @ weight.t() / 0.8, dim=-1)
    logprobs = torch.cat([log_probs.new_zeros(1), log_probs.gather(1, inputs["input_ids"][1:, None])[:, 0]])
    entropy = torch.cat([log_probs.new_zeros(1), -(log_probs.exp() * log_probs).sum(-1)])
    (inputs["a"] * logprobs + inputs["b"] * entropy).sum().backward()
    assert len({int(t) // 4 for t in inputs["input_ids"][1:]}) == 3  # targets on each rank that has rows
    torch.testing.assert_close(got["logprobs"], logprobs.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["entropy"], entropy.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["grad_hidden"], hidden.grad, rtol=1e-12, atol=1e-12)
    assert got["grad_weight"][3].shape == (0, 5)
    torch.testing.assert_close(torch.cat(got["grad_weight"]), weight.grad, rtol=1e-12, atol=1e-12)


def test_one_rank_resume_and_conversion_to_hf(one_rank, tmp_path):
    """The step-2 checkpoint resumes exactly on one rank; ``refractor convert`` writes its weights as an
    HF directory, and the FSDP trainer started from the checkpoint holds the same weights."""
    from refractor.megatron import parallel
    from refractor.megatron.trainer import MegatronTrainer
    from refractor.models.loading import iter_safetensors
    from refractor.trainer import Trainer
    from refractor.trainer.convert import export_hf
    from trainer._helpers import full_params

    megatron = one_rank["qwen2"]["megatron"]
    resumed = MegatronTrainer(megatron["trainer"].settings)
    try:
        assert resumed.load_checkpoint("latest") == 2
        at_step_2 = exported(resumed)
        metrics = resumed.train_step(batches(1)[2]).metrics
        after = exported(resumed)
    finally:
        parallel.stop()
    for key in COMPARED:
        assert metrics[key] == megatron["metrics"][2][key], key
    for name, tensor in after.items():
        assert torch.equal(tensor, megatron["export"][name]), name

    checkpoint = megatron["checkpoints"] / "step_2"
    converted = dict(iter_safetensors(export_hf(checkpoint, tmp_path / "hf", dtype="float32")))
    assert converted.keys() == at_step_2.keys()
    for name, tensor in at_step_2.items():
        assert torch.equal(converted[name], tensor), name
    fsdp = full_params(Trainer(settings(checkpoint, "fsdp", tmp_path / "fsdp")))
    for name, tensor in at_step_2.items():
        assert torch.equal(fsdp[name], tensor), name


def test_a_checkpoint_of_another_layout_or_backend_is_refused_naming_both(one_rank, four_ranks):
    from refractor.trainer.checkpoint import CheckpointError

    trainer = one_rank["qwen2"]["megatron"]["trainer"]
    own = trainer.checkpoint_dir
    try:
        trainer.checkpoint_dir = four_ranks["root"] / "tp2-pp2"
        with pytest.raises(CheckpointError, match=r"layout \{'tensor_parallel': 2, 'pipeline_parallel': 2\}"):
            trainer.load_checkpoint("latest")
        trainer.checkpoint_dir = own.parent / "fsdp"
        with pytest.raises(CheckpointError, match="saved by the fsdp trainer"):
            trainer.load_checkpoint("latest")
    finally:
        trainer.checkpoint_dir = own
