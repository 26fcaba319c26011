"""TrainerSettings: its defaults are the config schema's, and every key reaches its section."""

from __future__ import annotations

import pickle
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import pytest

from refractor.trainer.settings import TrainerSettings

pydantic_config = pytest.importorskip("refractor.config")


def leaf_defaults(cls) -> dict[str, object]:
    """Config key -> dataclass default, over the plain fields and every section."""
    out = {}
    for f in fields(cls):
        if f.default_factory is not MISSING:
            out.update(leaf_defaults(f.default_factory))
        elif f.default is not MISSING:
            out[f.name] = f.default
    return out


def flat_values(settings) -> dict[str, object]:
    """Config key -> value, over the plain fields and every section."""
    out = {}
    for f in fields(settings):
        value = getattr(settings, f.name)
        out.update(flat_values(value) if is_dataclass(value) else {f.name: value})
    return out


# keys whose schema default is resolved when a config loads: the trainer's default is the resolved value
# (megatron_sequence_parallel: Telescope's default, true, means "when it can run"; unset, it is false)
RESOLVED_AT_LOAD = {"megatron_sequence_parallel": False}


def test_every_default_equals_the_config_schema_default():
    schema = pydantic_config.RefractorConfig.model_fields
    defaults = leaf_defaults(TrainerSettings)
    assert set(defaults) == set(TrainerSettings.config_keys()) - {"model"}  # model has no default
    for key, default in defaults.items():
        assert key in schema, key
        assert default == RESOLVED_AT_LOAD.get(key, schema[key].default), key
    loaded = pydantic_config.RefractorConfig(environments=[{"name": "countdown"}])
    for key, default in RESOLVED_AT_LOAD.items():
        assert getattr(loaded, key) == default, key


def test_config_keys_are_distinct_config_fields():
    keys = TrainerSettings.config_keys()
    assert len(keys) == len(set(keys))
    assert set(keys) <= set(pydantic_config.RefractorConfig.model_fields)


def test_from_config_reads_every_key_into_its_section():
    cfg = pydantic_config.RefractorConfig(
        environments=[{"name": "countdown"}],
        model="some/model",
        mixed_precision_dtype=None,
        activation_checkpointing="selective",
        learning_rate=3e-4,
        grad_clip=0.5,
        lr_scheduler="cosine",
        temperature=0.7,
        trainer_pass_pad_multiple=512,
        algorithm="cispo",
        checkpoint_keep_last=3,
        resume_from_checkpoint=4,
        run_name="r",
    )
    s = TrainerSettings.from_config(cfg)
    assert s.model == "some/model" and s.mixed_precision_dtype is None
    assert s.activation_checkpointing == "selective"
    assert (s.optimizer.learning_rate, s.optimizer.grad_clip, s.optimizer.lr_scheduler) == (
        3e-4,
        0.5,
        "cosine",
    )
    assert s.optimizer.schedule.kind == "cosine" and s.optimizer.schedule.total_steps == 300
    assert (s.forward.temperature, s.forward.trainer_pass_pad_multiple) == (0.7, 512)
    assert s.loss.algorithm == "cispo"
    assert (s.checkpoint.checkpoint_keep_last, s.checkpoint.resume_from_checkpoint) == (3, 4)
    assert flat_values(s) == {key: getattr(cfg, key) for key in TrainerSettings.config_keys()}


def test_from_keys_routes_keys_and_rejects_unknown_ones():
    s = TrainerSettings.from_keys(model="m", weight_decay=0.1, entropy_coef=0.01, checkpoint_dir="/c")
    assert s.optimizer.weight_decay == 0.1 and s.loss.entropy_coef == 0.01
    assert s.checkpoint.root == Path("/c")
    assert s.optimizer.learning_rate == 1e-6  # untouched keys keep their defaults
    with pytest.raises(TypeError, match="seq_len"):
        TrainerSettings.from_keys(model="m", seq_len=128)


def test_checkpoint_root_is_checkpoint_dir_else_under_the_run():
    assert TrainerSettings.from_keys(model="m").checkpoint.root is None
    named = TrainerSettings.from_keys(model="m", run_dir="/runs", run_name="r")
    assert named.checkpoint.root == Path("/runs/r/checkpoints")
    explicit = TrainerSettings.from_keys(model="m", run_name="r", checkpoint_dir="/elsewhere")
    assert explicit.checkpoint.root == Path("/elsewhere")


def test_settings_are_frozen_and_picklable():
    s = TrainerSettings.from_keys(model="m", learning_rate=2e-5)
    assert pickle.loads(pickle.dumps(s)) == s
    with pytest.raises(AttributeError):
        s.model = "other"  # type: ignore[misc]
