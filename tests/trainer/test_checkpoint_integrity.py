"""Damaged checkpoints are named, never loaded: every file's size and SHA-256 is saved in meta.json;
resuming "latest" falls back to the newest intact checkpoint with a warning naming the bad file, or
fails in one line naming it; a save that fails on a full disk leaves the older checkpoints intact
and resumable; checkpoints saved without the record still load, without warnings."""

from __future__ import annotations

import errno
import json
import logging

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from refractor.config import RefractorConfig
from refractor.errors import RefractorUserError, RunSetupError
from refractor.telemetry.store import RunStore
from refractor.train import prepare_run
from refractor.trainer import Trainer
from refractor.trainer.checkpoint import (
    FILES_KEY,
    CheckpointError,
    CheckpointWriteError,
    checkpoint_damage,
    list_checkpoints,
    read_meta,
    resolve_checkpoint_step,
)

from ._helpers import full_params, make_samples, make_settings, pack, quiet_env

quiet_env()
LOGGER = "refractor.trainer.checkpoint"


@pytest.fixture
def two_checkpoints(tiny_qwen2_path, tmp_path):
    """<tmp>/run/checkpoints/step_1 and step_2 of a real trainer (a finished run's layout), and the
    trainer's weights at step 1."""
    root = tmp_path / "run" / "checkpoints"
    trainer = Trainer(make_settings(tiny_qwen2_path, checkpoint_dir=str(root)))
    trainer.train_step(pack(make_samples(n=3, seed=1), step=0))
    trainer.save_checkpoint(extra_files={"orchestrator.json": json.dumps({"next_sample_idx": 3})})
    params_step1 = full_params(trainer)
    trainer.train_step(pack(make_samples(n=3, seed=2), step=1))
    trainer.save_checkpoint(extra_files={"orchestrator.json": json.dumps({"next_sample_idx": 6})})
    return root, params_step1


def shard(checkpoint) -> object:
    shards = sorted(checkpoint.glob("*.distcp"))
    assert shards
    return shards[0]


def truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def run_config(tmp_path) -> RefractorConfig:
    return RefractorConfig(
        model="refractor-testing/tiny-qwen2",
        environments=[{"name": "countdown"}],
        run_dir=str(tmp_path),
        run_name="run",
        resume_from_checkpoint=True,
    )


def finished_store(root) -> None:
    store = RunStore(root, run_name="run")
    store.log_step_metrics(0, {"loss": 1.0})
    store.close("finished")


def test_meta_json_records_the_size_and_sha256_of_every_file(two_checkpoints):
    import hashlib

    root, _ = two_checkpoints
    path = root / "step_2"
    recorded = read_meta(path)[FILES_KEY]
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {"meta.json"}
    assert set(recorded) == on_disk and {"orchestrator.json", ".metadata", "hf_meta/config.json"} <= on_disk
    for name, record in recorded.items():
        data = (path / name).read_bytes()
        assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def test_a_truncated_shard_of_the_newest_checkpoint_resumes_the_older_one_with_a_warning(
    two_checkpoints, tiny_qwen2_path, tmp_path, caplog
):
    root, params_step1 = two_checkpoints
    bad = shard(root / "step_2")
    truncate(bad)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert resolve_checkpoint_step(root, True, checksums=True) == 1
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1 and str(bad) in warnings[0] and "resuming from step_1 instead" in warnings[0]

    finished_store(tmp_path / "run")  # the driver's check picks step 1 before anything starts
    cfg, _, lock = prepare_run(run_config(tmp_path))
    lock.release()
    assert cfg.resume_from_checkpoint == 1

    resumed = Trainer(make_settings(tiny_qwen2_path, checkpoint_dir=str(root)))
    assert resumed.load_checkpoint("latest") == 1 and resumed.step == 1
    for name, p in full_params(resumed).items():
        assert torch.equal(p, params_step1[name]), name


def test_a_truncated_only_checkpoint_fails_in_one_line_naming_the_file(two_checkpoints, tmp_path):
    root, _ = two_checkpoints
    for step in (1, 2):
        truncate(shard(root / f"step_{step}"))
    finished_store(tmp_path / "run")
    with pytest.raises(RunSetupError) as err:
        prepare_run(run_config(tmp_path))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"cannot resume {tmp_path / 'run'}")
    assert str(shard(root / "step_2")) in message and "truncated" in message
    assert "1 older damaged checkpoint" in message
    # an explicit step is never swapped for another one
    with pytest.raises(CheckpointError, match="step_1/__0_0.distcp has \\d+ bytes where \\d+ were saved"):
        resolve_checkpoint_step(root, 1)


def test_a_flipped_byte_is_found_by_the_checksum_and_a_missing_file_by_name(two_checkpoints):
    root, _ = two_checkpoints
    path = shard(root / "step_2")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert checkpoint_damage(root / "step_2", checksums=False) is None  # same size
    assert checkpoint_damage(root / "step_2", checksums=True) == (
        f"{path} does not match the SHA-256 saved with it (corrupted)"
    )
    (root / "step_1" / "rng_state_rank_0.pt").unlink()
    assert (
        checkpoint_damage(root / "step_1", checksums=False) == f"{root}/step_1/rng_state_rank_0.pt is missing"
    )


@pytest.mark.parametrize("name", ["meta.json", "orchestrator.json"])
def test_a_truncated_json_file_is_named_and_skipped(two_checkpoints, name, caplog):
    root, _ = two_checkpoints
    truncate(root / "step_2" / name)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert resolve_checkpoint_step(root, "latest") == 1
    (warning,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert str(root / "step_2" / name) in warning
    if name == "meta.json":
        with pytest.raises(CheckpointError, match="meta.json is damaged \\(not valid JSON"):
            read_meta(root / "step_2")


def test_a_checkpoint_saved_without_the_record_still_loads_without_warnings(
    two_checkpoints, tiny_qwen2_path, caplog
):
    root, _ = two_checkpoints
    for step in (1, 2):
        meta_file = root / f"step_{step}" / "meta.json"
        meta = json.loads(meta_file.read_text())
        del meta[FILES_KEY]
        meta_file.write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert resolve_checkpoint_step(root, True, checksums=True) == 2
        trainer = Trainer(make_settings(tiny_qwen2_path, checkpoint_dir=str(root)))
        assert trainer.load_checkpoint("latest") == 2
    assert not [r for r in caplog.records if r.name == LOGGER]
    truncate(root / "step_2" / "orchestrator.json")  # what can still be checked is
    assert "orchestrator.json is damaged" in checkpoint_damage(root / "step_2", checksums=True)


def test_a_full_disk_during_a_save_leaves_the_previous_checkpoint_resumable(
    two_checkpoints, tiny_qwen2_path, monkeypatch
):
    """The disk is not the unit under test: its write fails half way with ENOSPC, as a full one does."""
    root, _ = two_checkpoints
    trainer = Trainer(make_settings(tiny_qwen2_path, checkpoint_dir=str(root)))
    assert trainer.load_checkpoint("latest") == 2
    params_step2 = full_params(trainer)
    trainer.train_step(pack(make_samples(n=3, seed=3), step=2))
    write_item = dcp_filesystem._write_item

    def disk_full(transforms, stream, data, write_item_, storage_key, serialization_format):
        stream.write(b"\0" * 100)  # part of the shard made it to disk
        raise OSError(errno.ENOSPC, "No space left on device", getattr(stream, "name", "shard"))

    monkeypatch.setattr(dcp_filesystem, "_write_item", disk_full)
    with pytest.raises(CheckpointWriteError) as err:
        trainer.save_checkpoint(extra_files={"orchestrator.json": "{}"})
    monkeypatch.setattr(dcp_filesystem, "_write_item", write_item)
    message = str(err.value)
    assert isinstance(err.value, RefractorUserError) and "\n" not in message
    assert message.startswith(f"could not write checkpoint {root / 'step_3'}: No space left on device")
    assert f"the newest checkpoint, {root / 'step_2'}, is untouched" in message
    assert "--resume_from_checkpoint true" in message
    assert not (root / "step_3_tmp").exists()  # the partial directory gave its space back
    assert list_checkpoints(root) == [1, 2]
    assert checkpoint_damage(root / "step_2", checksums=True) is None
    assert resolve_checkpoint_step(root, True, checksums=True) == 2

    resumed = Trainer(make_settings(tiny_qwen2_path, checkpoint_dir=str(root)))
    assert resumed.load_checkpoint(True) == 2
    for name, p in full_params(resumed).items():
        assert torch.equal(p, params_step2[name]), name
    trainer.save_checkpoint()  # with space again, the next save works
    assert list_checkpoints(root) == [1, 2, 3] and checkpoint_damage(root / "step_3", checksums=True) is None


def test_convert_names_the_damaged_file_in_one_line(two_checkpoints, tmp_path):
    from typer.testing import CliRunner

    from refractor.cli import app

    root, _ = two_checkpoints
    bad = shard(root / "step_2")
    truncate(bad)
    res = CliRunner().invoke(app, ["convert", str(root / "step_2"), str(tmp_path / "hf")])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert f"cannot be converted: {bad} has" in res.output and not (tmp_path / "hf").exists()
