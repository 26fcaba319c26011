"""Mixed precision of the Megatron trainer (CPU, gloo, one rank): ``mixed_precision_dtype`` bfloat16 or
float16 is the dtype of the model's parameters and compute, over float32 master weights, gradients and
AdamW state (``refractor.megatron.precision``).

* A packed row's forward in bf16 / fp16 gives float32 log-probs and entropies within a few units of
  the dtype's rounding of a float64 forward of the same weights; float32 is within 1e-5 of it.
* Three training steps in bf16 and in fp16 stay near the float32 steps: loss, grad norm, entropy and
  KL to the rollout policy within 2e-2 relative (measured: at most 2.3e-3, on the KL, in either dtype),
  and are not the float32 steps (the compute ran in the low dtype); after every update the model's
  parameters are the float32 masters rounded, and the AdamW state is float32; a resumed bf16 run
  equals the run without the stop.
* On CPU the config's bf16 computes in float32 unless the trainer is told otherwise (as the FSDP trainer
  decides, logged); a ``model_dtype`` other than float32 is refused naming the key.

The CPU runs pass ``MegatronTrainer(..., mixed_precision=True)``: a CUDA rank applies
``mixed_precision_dtype`` by default.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from refractor.models import ModelConfig, read_hf_config

from ._cpu_forward import MEGATRON_WARNINGS, quiet_megatron
from ._models import build
from ._trainer_runs import ARCHS, assert_resumes_exactly, batches, exported, run_three_steps, settings

with warnings.catch_warnings():
    quiet_megatron()
    pytest.importorskip(
        "megatron.core", reason="megatron-core is the `megatron` extra (scripts/install.sh --dev)"
    )
pytestmark = [pytest.mark.filterwarnings(f"ignore:.*{text}.*:UserWarning") for text in MEGATRON_WARNINGS]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
COMPARED = ("loss", "grad_norm", "entropy", "kl_divergence_inference")
STEP_RTOL = 2e-2
RESUMED = ("qwen2", "bfloat16")


def _train(arch: str, dtype: str | None, root, checkpoint: bool) -> dict:
    """Three steps of a one-rank Megatron trainer computing in ``dtype`` (None: float32); with
    ``checkpoint``, a checkpoint after the second."""
    from refractor.megatron import parallel
    from refractor.megatron.trainer import MegatronTrainer

    keys = settings(build(arch), "megatron", root / arch / str(dtype), mixed_precision_dtype=dtype)
    trainer = MegatronTrainer(keys, mixed_precision=True)
    try:
        if checkpoint:
            run = run_three_steps(trainer, 1)
        else:
            run = {
                "metrics": [trainer.train_step(b).metrics for b in batches(1)],
                "export": exported(trainer),
            }
        return {
            **run,
            "settings": keys,
            "model": dict(trainer.model.named_parameters()),
            "masters": trainer.params,
            "adamw": trainer.optimizer.state(),
            "compute_dtype": trainer.compute_dtype,
        }
    finally:
        parallel.stop()


@pytest.fixture(scope="module")
def runs(world, tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")
    return {
        (arch, dtype): _train(arch, dtype, root, checkpoint=(arch, dtype) == RESUMED)
        for arch in ARCHS
        for dtype in (None, *DTYPES)
    }


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_low_precision_forward_gives_float32_log_probs_near_a_float64_forward(world, dtype):
    """Qwen3 (q/k norms) on a packed row of 3 samples and padding: float64 is the reference."""
    from refractor.megatron import parallel
    from refractor.megatron.forward import row_logprobs, stage_forward
    from refractor.megatron.layout import ParallelSizes
    from refractor.megatron.model import build_gpt_model
    from refractor.megatron.shards import MegatronLayout, hf_to_shards
    from refractor.models.loading import iter_safetensors

    path = build("qwen3")
    config = ModelConfig.from_hf(read_hf_config(path))
    ((shard,),) = hf_to_shards(dict(iter_safetensors(path)), config, MegatronLayout())
    mb = batches(1)[0].micro_batches[0][0]
    trained = mb.loss_mask.bool()
    ranks = parallel.start(ParallelSizes(), torch.device("cpu"))
    try:
        out = {}
        for compute in (torch.float64, torch.float32, DTYPES[dtype]):
            model = build_gpt_model(config, MegatronLayout(), compute)
            model.load_state_dict(shard, strict=True)
            with torch.no_grad():
                hidden = stage_forward(model, mb, None)
                logprobs, entropy = row_logprobs(model, hidden, mb, config.vocab_size, ranks, 0.8, 48)
            assert hidden.dtype == compute
            out[compute] = (logprobs[trained], entropy[trained])
    finally:
        parallel.stop()
    reference = out[torch.float64]
    for compute, bound in ((torch.float32, 1e-5), (DTYPES[dtype], 8 * UNIT_ROUNDOFF[DTYPES[dtype]])):
        logprobs, entropy = out[compute]
        assert logprobs.dtype == entropy.dtype == torch.float32
        lp_error = (logprobs.double() - reference[0]).abs().max().item()
        entropy_error = (entropy.double() - reference[1]).abs().max().item()
        assert lp_error <= bound and entropy_error <= bound, (compute, lp_error, entropy_error)
    low_error = (out[DTYPES[dtype]][0].double() - reference[0]).abs().max().item()
    assert low_error > 1e-5  # the compute ran in the low dtype


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_low_precision_steps_stay_near_the_float32_steps(runs, arch, dtype):
    low, full = runs[(arch, dtype)], runs[(arch, None)]
    assert low["compute_dtype"] == DTYPES[dtype] and full["compute_dtype"] == torch.float32
    gaps = {key: [] for key in COMPARED}
    for step, (got, want) in enumerate(zip(low["metrics"], full["metrics"], strict=True)):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=STEP_RTOL), (step, key)
            gaps[key].append(abs(got[key] - want[key]) / abs(want[key]))
        assert got["trainer/optimizer/skipped_updates"] == 0
    assert max(gaps["grad_norm"]) > 1e-5  # not the float32 steps: the float32 runs agree within 1e-6


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_model_holds_the_float32_masters_rounded_and_adamw_state_is_float32(runs, dtype):
    run = runs[("qwen2", dtype)]
    assert run["model"].keys() == run["masters"].keys()
    for name, param in run["model"].items():
        master = run["masters"][name]
        assert param.dtype == DTYPES[dtype] and master.dtype == torch.float32, name
        assert torch.equal(param, master.to(param.dtype)), name
        assert param.grad is None and master.grad is None, name
    for name, state in run["adamw"].items():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32, name
        assert state["step"].item() == 4, name  # four updates: the second step has two minibatches
    # the export reads the masters: float32 weights that moved from the float32 run's by less than
    # the four updates at lr 1e-3 could move them
    full = runs[("qwen2", None)]["export"]
    for name, tensor in run["export"].items():
        assert tensor.dtype == torch.float32
        assert (tensor - full[name]).abs().max().item() <= 4 * 1e-3 + 1e-6, name


def test_a_bf16_run_resumes_exactly(runs):
    """The checkpoint holds the float32 masters: the step after a resume equals the step without the stop."""
    from refractor.megatron.trainer import MegatronTrainer

    run = runs[RESUMED]
    resumed = MegatronTrainer(run["settings"], mixed_precision=True)
    assert_resumes_exactly(resumed, run, COMPARED)


def test_on_cpu_the_config_dtype_computes_in_float32_unless_asked(world, tmp_path, caplog):
    from refractor.megatron import parallel
    from refractor.megatron.trainer import MegatronTrainer

    keys = settings(build("qwen2"), "megatron", tmp_path, mixed_precision_dtype="bfloat16")
    with caplog.at_level(logging.INFO, logger="refractor.megatron.trainer"):
        trainer = MegatronTrainer(keys)
    parallel.stop()
    assert trainer.compute_dtype == torch.float32
    assert next(trainer.model.parameters()).dtype == torch.float32
    assert "computing in float32 (mixed_precision_dtype=bfloat16 applies on CUDA)" in caplog.text
    assert "compute in float32" in caplog.text
    refused = settings(build("qwen2"), "megatron", tmp_path, model_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"`model_dtype: bfloat16`: the Megatron trainer keeps float32"):
        MegatronTrainer(refused, mixed_precision=True)
