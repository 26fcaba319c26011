"""Checkpoint discovery and retention on plain directories (no process group needed)."""

from __future__ import annotations

import json

import pytest

from refractor.trainer.checkpoint import (
    CheckpointError,
    apply_retention,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    resolve_checkpoint_step,
    retained_steps,
)


def fake_checkpoint(root, step, complete=True, suffix=""):
    d = root / f"step_{step}{suffix}"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x")
    if complete:
        (d / "meta.json").write_text(json.dumps({"step": step}))
    return d


def test_interrupted_checkpoints_are_never_latest(tmp_path):
    fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 20, suffix="_tmp")  # interrupted before the rename
    fake_checkpoint(tmp_path, 30, complete=False)  # renamed dir without meta.json (manual copy, crash)
    fake_checkpoint(tmp_path, 40, suffix="_old_tmp")  # leftover of a replacement
    (tmp_path / "step_x").mkdir()
    assert list_checkpoints(tmp_path) == [10]
    assert latest_checkpoint(tmp_path) == 10
    assert resolve_checkpoint_step(tmp_path, True) == 10
    assert resolve_checkpoint_step(tmp_path, "latest") == 10
    assert resolve_checkpoint_step(tmp_path, 10) == 10
    with pytest.raises(CheckpointError, match="step_30 is missing or incomplete"):
        resolve_checkpoint_step(tmp_path, 30)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_checkpoint_step(tmp_path / "empty", True)


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "expected"),
    [
        (None, None, [2, 4, 6, 8, 10, 12]),  # retention off: keep everything
        (2, None, [10, 12]),
        (None, 4, [4, 8, 12]),
        (2, 4, [4, 8, 10, 12]),
        (1, 5, [10, 12]),
    ],
)
def test_retention_deletes_exactly_the_right_checkpoints(tmp_path, keep_last, keep_every, expected):
    for s in (2, 4, 6, 8, 10, 12):
        fake_checkpoint(tmp_path, s)
    tmp = fake_checkpoint(tmp_path, 14, suffix="_tmp")  # an in-flight save is not retention's business
    deleted = apply_retention(tmp_path, current=12, keep_last=keep_last, keep_every=keep_every)
    assert list_checkpoints(tmp_path) == expected
    assert sorted(deleted) == sorted({2, 4, 6, 8, 10, 12} - set(expected))
    assert tmp.is_dir()


def test_current_step_is_always_kept():
    assert 7 in retained_steps([3, 5, 7, 9], current=7, keep_last=1, keep_every=None)
    assert retained_steps([3, 5, 7, 9], current=7, keep_last=1, keep_every=None) == {7, 9}


def test_checkpoint_path_layout(tmp_path):
    assert checkpoint_path(tmp_path, 5) == tmp_path / "step_5"
