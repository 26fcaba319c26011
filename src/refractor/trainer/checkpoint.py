"""Native checkpoints: sharded DCP state, written atomically, with retention and discovery.

Layout of ``<checkpoint_dir>/step_<N>/`` (written as ``step_<N>_tmp`` and renamed by rank 0):

    .metadata, *.distcp        torch.distributed.checkpoint of {"model": HF-named weights, "step": N,
                               + "optimizer", "scheduler" when training state is saved}
    rng_state_rank_<r>.pt      python / numpy / torch / cuda RNG of each rank (training state only)
    hf_meta/                   config.json, tokenizer and generation files of the base model
    <extra files>              e.g. the orchestrator's orchestrator.json
    meta.json                  written last: {"format", "step", "backend", "base_model",
                               "training_state", ...}

A directory counts as a checkpoint only when it is named exactly ``step_<N>`` and holds
``meta.json``; a save interrupted at any point leaves a ``_tmp`` directory (or no meta.json) and
is never picked as the latest.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from refractor.errors import RefractorUserError

CHECKPOINT_FORMAT = "refractor-dcp-1"
META_FILE = "meta.json"
HF_META_DIR = "hf_meta"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Files of the base model copied to hf_meta (everything but weights), so conversion works offline.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")
_WEIGHT_INDEX = re.compile(r".*\.(safetensors|bin)\.index\.json$")


class CheckpointError(RefractorUserError, RuntimeError):
    """A checkpoint that cannot be used as asked (missing, incomplete, weights-only for resume)."""


def checkpoint_path(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def is_complete_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    return _STEP_DIR.match(p.name) is not None and (p / META_FILE).is_file()


def list_checkpoints(root: str | Path) -> list[int]:
    """Steps of the complete checkpoints under ``root``, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and is_complete_checkpoint(child):
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_checkpoint(root: str | Path) -> int | None:
    steps = list_checkpoints(root)
    return steps[-1] if steps else None


def resolve_checkpoint_step(root: str | Path, which: int | str | bool) -> int:
    """``"latest"``/``True`` -> the newest complete step; an int -> that step (must be complete)."""
    if which is True or which == "latest":
        step = latest_checkpoint(root)
        if step is None:
            raise CheckpointError(
                f"resume_from_checkpoint: no complete checkpoint (step_N with {META_FILE}) in {root}"
            )
        return step
    if isinstance(which, bool) or not isinstance(which, int):
        raise CheckpointError(f"checkpoint selector must be 'latest', true or a step number, got {which!r}")
    if not is_complete_checkpoint(checkpoint_path(root, which)):
        have = list_checkpoints(root)
        raise CheckpointError(
            f"resume_from_checkpoint: {checkpoint_path(root, which)} is missing or incomplete "
            f"(complete checkpoints: {have or 'none'})"
        )
    return which


def read_meta(path: str | Path) -> dict[str, Any]:
    meta_file = Path(path) / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a refractor checkpoint (no {META_FILE})")
    return json.loads(meta_file.read_text())


# ---------------------------------------------------------------- retention (docs/run-store.md#checkpoints)
def retained_steps(steps: list[int], current: int, keep_last: int | None, keep_every: int | None) -> set[int]:
    """Steps that survive retention: the current one, the last ``keep_last``, multiples of ``keep_every``."""
    if keep_last is None and keep_every is None:
        return set(steps)
    keep = {current}
    if keep_last:
        keep.update(sorted(steps)[-keep_last:])
    if keep_every:
        keep.update(s for s in steps if s % keep_every == 0)
    return keep


def apply_retention(
    root: str | Path, current: int, keep_last: int | None, keep_every: int | None
) -> list[int]:
    """Delete complete checkpoints that retention does not keep; returns the deleted steps."""
    steps = list_checkpoints(root)
    doomed = sorted(set(steps) - retained_steps(steps, current, keep_last, keep_every))
    for step in doomed:
        shutil.rmtree(checkpoint_path(root, step), ignore_errors=True)
    return doomed


# ---------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- save / load (collective)
def save_checkpoint(
    root: str | Path,
    step: int,
    state: dict[str, Any],
    *,
    meta: dict[str, Any],
    base_model_dir: str | Path | None,
    extra_files: Mapping[str, str | bytes] | None = None,
    save_rng: bool = True,
    after_rename: Callable[[], None] | None = None,
) -> Path:
    """Write ``state`` (a DCP state dict) to ``root/step_<step>`` atomically. Call on every rank.

    Rank 0 adds hf_meta/, ``extra_files`` (name -> content) and meta.json before renaming
    ``step_<step>_tmp`` to ``step_<step>`` (replacing an older copy), then runs ``after_rename``.
    """
    rank = dist.get_rank()
    final = checkpoint_path(root, step)
    tmp = final.with_name(final.name + "_tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    if save_rng:
        torch.save(rng_state(), tmp / f"rng_state_rank_{rank}.pt")
    dist.barrier()
    if rank == 0:
        if base_model_dir is not None:
            copy_hf_meta(base_model_dir, tmp / HF_META_DIR)
        for name, content in (extra_files or {}).items():
            _check_extra_name(name)
            target = tmp / name
            target.write_bytes(content if isinstance(content, bytes) else content.encode())
        full_meta = {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "backend": "fsdp",
            "world_size": dist.get_world_size(),
            "training_state": "optimizer" in state,
            **meta,
        }
        _write_json_durably(tmp / META_FILE, full_meta)
        _replace_dir(tmp, final)
        if after_rename is not None:
            after_rename()
    dist.barrier()
    return final


def load_checkpoint_state(path: str | Path, state: dict[str, Any], *, restore_rng: bool) -> None:
    """Fill ``state`` (a DCP skeleton with the entries to read) in place from ``path``; call on every rank."""
    dcp.load(state, checkpoint_id=str(path))
    if restore_rng:
        rng_file = Path(path) / f"rng_state_rank_{dist.get_rank()}.pt"
        if not rng_file.is_file():
            raise CheckpointError(
                f"{rng_file} is missing: the checkpoint was saved by a different number of "
                "ranks or without training state"
            )
        set_rng_state(torch.load(rng_file, weights_only=False))


def copy_hf_meta(model_dir: str | Path, out: Path) -> None:
    """Copy every non-weight file of an HF model directory (config, tokenizer, generation config)."""
    src = Path(model_dir)
    if (src / HF_META_DIR).is_dir():  # the base model is itself a refractor checkpoint
        src = src / HF_META_DIR
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and not _WEIGHT_INDEX.match(f.name):
            shutil.copy2(f, out / f.name)


def _check_extra_name(name: str) -> None:
    if "/" in name or name.startswith(".") or name in (META_FILE, HF_META_DIR) or name.endswith(".distcp"):
        raise ValueError(
            f"extra checkpoint file name {name!r} is not allowed (plain file names only, not "
            f"{META_FILE}, {HF_META_DIR}, .metadata or *.distcp)"
        )


def _write_json_durably(path: Path, payload: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is moved aside first and deleted after."""
    old = dst.with_name(dst.name + "_old_tmp")
    if dst.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)
