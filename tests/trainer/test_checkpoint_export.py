"""Checkpoints (exact resume, atomicity, retention, weights-only), HF export, bucketed weight export."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from typer.testing import CliRunner

from refractor.trainer import Trainer
from refractor.trainer.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, read_meta
from refractor.trainer.convert import export_hf

from ._helpers import full_params, make_samples, make_settings, pack, quiet_env

quiet_env()


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tiny_qwen2_path, tmp_path):
    settings = make_settings(
        tiny_qwen2_path,
        checkpoint_dir=str(tmp_path),
        lr_scheduler="cosine",
        warmup_steps=1,
        number_of_steps=4,
        weight_decay=0.01,
        checkpoint_keep_last=2,
    )
    batches = [pack(make_samples(seed=10 + i), step=i) for i in range(3)]
    first = Trainer(settings)
    first.train_step(batches[0])
    first.train_step(batches[1])
    first.save_checkpoint(extra_files={"orchestrator.json": json.dumps({"next_sample_idx": 7})})
    rng_after_save = torch.rand(4)
    expected = first.train_step(batches[2]).metrics
    expected_params = full_params(first)

    resumed = Trainer(settings)
    torch.rand(11)  # a different RNG position: load must restore it
    assert resumed.load_checkpoint("latest") == 2 and resumed.step == 2
    assert torch.equal(torch.rand(4), rng_after_save)
    got = resumed.train_step(batches[2]).metrics
    for key in ("loss", "grad_norm", "learning_rate", "entropy", "kl_divergence_inference"):
        assert got[key] == expected[key], key  # bitwise on CPU fp32
    assert (
        got["learning_rate"] != settings.optimizer.learning_rate
    )  # the schedule position was restored, not restarted
    for name, p in full_params(resumed).items():
        assert torch.equal(p, expected_params[name]), name

    path = tmp_path / "step_2"
    meta = read_meta(path)
    assert meta["step"] == 2 and meta["training_state"] and meta["backend"] == "fsdp"
    assert json.loads((path / "orchestrator.json").read_text()) == {"next_sample_idx": 7}
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= {
        f.name for f in (path / "hf_meta").iterdir()
    }
    assert (path / "rng_state_rank_0.pt").is_file()

    # Retention (keep_last=2) runs after every save; a re-save of the same step replaces it.
    for step in (3, 4, 4):
        resumed.save_checkpoint(step)
    assert list_checkpoints(tmp_path) == [3, 4]


def test_a_save_interrupted_mid_write_is_never_picked(tiny_qwen2_path, tmp_path):
    trainer = Trainer(make_settings(tiny_qwen2_path, checkpoint_dir=str(tmp_path)))
    trainer.train_step(pack(make_samples(n=3)))
    trainer.save_checkpoint(1)
    # Fails after the DCP shards are written, before meta.json and the rename (a crash there).
    with pytest.raises(ValueError, match="not allowed"):
        trainer.save_checkpoint(2, extra_files={"../escape.json": "{}"})
    assert (tmp_path / "step_2_tmp" / ".metadata").is_file()
    assert latest_checkpoint(tmp_path) == 1
    assert trainer.load_checkpoint(True) == 1


def test_weights_only_checkpoint_initializes_a_run_but_cannot_resume(tiny_llama_path, tmp_path):
    settings = make_settings(
        tiny_llama_path, checkpoint_dir=str(tmp_path), checkpoint_save_training_state=False
    )
    trainer = Trainer(settings)
    trainer.train_step(pack(make_samples(n=3)))
    path = trainer.save_checkpoint()
    assert not (path / "rng_state_rank_0.pt").exists() and not read_meta(path)["training_state"]
    with pytest.raises(CheckpointError, match="weights only"):
        trainer.load_checkpoint(1)
    saved = full_params(trainer)
    fresh = Trainer(make_settings(path))
    assert fresh.step == 0
    for name, p in full_params(fresh).items():
        assert torch.equal(p, saved[name]), name


def trainer_logits(trainer: Trainer, ids: torch.Tensor) -> torch.Tensor:
    from refractor.models import CausalAttention

    trainer.model.unshard()  # the root's embedding / norm / head; layers unshard themselves
    with torch.no_grad():
        hidden = trainer.model.lm(ids, torch.arange(len(ids)), attention=CausalAttention())
        logits = trainer.model.lm.compute_logits(hidden)
    trainer.model.reshard()
    return logits


@pytest.mark.parametrize("fixture", ["tiny_qwen2_path", "tiny_llama_path"])  # tied and untied heads
def test_hf_export_round_trip_loads_in_transformers_with_the_trainers_logits(fixture, request, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    settings = make_settings(request.getfixturevalue(fixture), checkpoint_dir=str(tmp_path / "ckpt"))
    trainer = Trainer(settings)
    trainer.train_step(pack(make_samples(n=4)))
    ckpt = trainer.save_checkpoint()
    out = tmp_path / "hf"
    if fixture == "tiny_qwen2_path":  # through the CLI, split into several shards
        from refractor.cli import app

        res = CliRunner().invoke(app, ["convert", str(ckpt), str(out), "--max-shard-size", "100KB"])
        assert res.exit_code == 0, res.output
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" not in index["weight_map"]
    else:
        export_hf(ckpt, out)
        assert (out / "model.safetensors").is_file()
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor(make_samples(n=1, seed=3)[0].input_ids)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(trainer_logits(trainer, ids), expected, rtol=1e-5, atol=1e-5)
    assert AutoTokenizer.from_pretrained(out).eos_token == "<|im_end|>"
    assert GenerationConfig.from_pretrained(out).eos_token_id is not None
    assert json.loads((out / "config.json").read_text()).get("dtype", "float32") == "float32"


def test_convert_refuses_a_non_checkpoint_with_one_clear_message(tmp_path, tiny_qwen2_path):
    from refractor.cli import app

    res = CliRunner().invoke(app, ["convert", str(tiny_qwen2_path), str(tmp_path / "out")])
    assert res.exit_code == 2 and "not a refractor checkpoint" in res.output


def test_weight_buckets_concatenate_to_the_full_weights_one_bucket_at_a_time(tiny_llama_path):
    trainer = Trainer(make_settings(tiny_llama_path))
    expected = full_params(trainer)
    bucket_bytes = 96 * 1024
    seen: dict[str, torch.Tensor] = {}
    previous: list[weakref.ref] = []
    whole = [pair for bucket in trainer.export_weight_buckets(bucket_mb=64) for pair in bucket]
    assert [n for n, _ in whole] == list(expected) and whole[0][
        1
    ].dtype == torch.float32  # the config's dtype
    live = {p.to_local().data_ptr() for p in trainer.model.parameters()}
    assert not live & {t.data_ptr() for _, t in whole}  # copies, never views of live parameters
    del whole
    for bucket in iter_buckets(trainer, bucket_bytes):
        # The exporter keeps nothing of earlier buckets: peak memory is about one bucket.
        gc.collect()
        assert all(ref() is None for ref in previous)
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        assert nbytes <= bucket_bytes or len(bucket) == 1
        for name, t in bucket:
            assert name not in seen
            seen[name] = t.clone()
        previous = [weakref.ref(t) for _, t in bucket]
        del bucket, t
    assert list(seen) == list(expected)  # HF names, named_parameters order
    for name, t in seen.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, expected[name].to(torch.bfloat16)), name


def iter_buckets(trainer: Trainer, bucket_bytes: int):
    from refractor.weight_sync.gather import iter_weight_buckets

    yield from iter_weight_buckets(trainer.model, bucket_bytes, torch.bfloat16)
