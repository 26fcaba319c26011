"""Native checkpoints: sharded DCP state, written atomically, with retention and discovery.

Layout of ``<checkpoint_dir>/step_<N>/`` (written as ``step_<N>_tmp`` and renamed by rank 0):

    .metadata, *.distcp        torch.distributed.checkpoint of {"model": HF-named weights, "step": N,
                               + "optimizer", "scheduler" when training state is saved}
    rng_state_rank_<r>.pt      python / numpy / torch / cuda RNG of each rank (training state only)
    hf_meta/                   config.json, tokenizer and generation files of the base model
    <extra files>              e.g. the orchestrator's orchestrator.json
    meta.json                  written last: {"format", "step", "backend", "base_model",
                               "training_state", "files": {path: {"size", "sha256"}}, ...}

A directory counts as a checkpoint only when it is named exactly ``step_<N>`` and holds
``meta.json``; a save interrupted at any point (a crash, a full disk) leaves a ``_tmp`` directory
(or no meta.json) and is never picked as the latest, and every file is flushed to disk before the
rename. Resuming checks each file against the sizes (and, where asked, checksums) in ``meta.json``:
"latest" falls back to the newest intact checkpoint with a warning naming the damaged file.
Checkpoints saved without a ``files`` record are checked only for readable JSON files.
"""

from __future__ import annotations

import contextlib
import json
import logging
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
from torch.distributed.checkpoint.api import CheckpointException

from refractor.errors import RefractorUserError
from refractor.trainer.checkpoint_files import FileRecord, find_damage, fsync_dir, record_files
from refractor.trainer.fp8 import plain_tensors
from refractor.trainer.timing import StepTimer

CHECKPOINT_FORMAT = "refractor-dcp-1"
META_FILE = "meta.json"
HF_META_DIR = "hf_meta"
FILES_KEY = "files"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Files of the base model copied to hf_meta (everything but weights), so conversion works offline.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")
_WEIGHT_INDEX = re.compile(r".*\.(safetensors|bin)\.index\.json$")

log = logging.getLogger(__name__)


class CheckpointError(RefractorUserError, RuntimeError):
    """A checkpoint that cannot be used as asked (missing, incomplete, damaged, weights-only for resume)."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (full disk, no permission); the older ones are intact."""


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


def resolve_checkpoint_step(root: str | Path, which: int | str | bool, *, checksums: bool = False) -> int:
    """``"latest"``/``True`` -> the newest intact step (damaged newer ones are skipped with a warning
    naming the bad file); an int -> that step, which must be intact. ``checksums`` also compares
    every file's SHA-256 (reads the whole checkpoint), else sizes only."""
    if which is True or which == "latest":
        steps = list_checkpoints(root)
        if not steps:
            raise CheckpointError(
                f"resume_from_checkpoint: no complete checkpoint (step_N with {META_FILE}) in {root}"
            )
        damaged: list[str] = []
        for step in reversed(steps):
            damage = checkpoint_damage(checkpoint_path(root, step), checksums=checksums)
            if damage is None:
                for problem in damaged:
                    log.warning("checkpoint skipped: %s; resuming from step_%d instead", problem, step)
                return step
            damaged.append(damage)
        others = f" (and {len(damaged) - 1} older damaged checkpoint(s))" if len(damaged) > 1 else ""
        raise CheckpointError(f"resume_from_checkpoint: no intact checkpoint in {root}: {damaged[0]}{others}")
    if isinstance(which, bool) or not isinstance(which, int):
        raise CheckpointError(f"checkpoint selector must be 'latest', true or a step number, got {which!r}")
    if not is_complete_checkpoint(checkpoint_path(root, which)):
        have = list_checkpoints(root)
        raise CheckpointError(
            f"resume_from_checkpoint: {checkpoint_path(root, which)} is missing or incomplete "
            f"(complete checkpoints: {have or 'none'})"
        )
    damage = checkpoint_damage(checkpoint_path(root, which), checksums=checksums)
    if damage is not None:
        raise CheckpointError(
            f"resume_from_checkpoint: {damage}; pick another step (complete checkpoints: "
            f"{list_checkpoints(root)}) or `true` for the newest intact one"
        )
    return which


def read_meta(path: str | Path) -> dict[str, Any]:
    meta_file = Path(path) / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a refractor checkpoint (no {META_FILE})")
    try:
        meta = json.loads(meta_file.read_bytes())
    except ValueError as err:
        raise CheckpointError(f"{meta_file} is damaged (not valid JSON: {err})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_file} is damaged (a JSON object was expected)")
    return meta


def checkpoint_damage(path: str | Path, *, checksums: bool) -> str | None:
    """One line naming the first damaged file of the checkpoint at ``path``, or None when it is intact."""
    path = Path(path)
    try:
        meta = read_meta(path)
    except CheckpointError as err:
        return str(err)
    recorded = meta.get(FILES_KEY)
    if recorded is None:  # saved before files were recorded: only its JSON files can be checked
        for json_file in sorted(path.glob("*.json")):
            try:
                json.loads(json_file.read_bytes())
            except ValueError as err:
                return f"{json_file} is damaged (not valid JSON: {err})"
        return None
    try:
        records = {name: FileRecord.from_json(r) for name, r in recorded.items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        return f"{path / META_FILE} is damaged (its `{FILES_KEY}` record is unreadable)"
    return find_damage(path, records, checksums)


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
    timer: StepTimer | None = None,
) -> Path:
    """Write ``state`` (a DCP state dict) to ``root/step_<step>`` atomically. Call on every rank.

    Rank 0 adds hf_meta/, ``extra_files`` (name -> content) and meta.json (with every file's size
    and SHA-256) before renaming ``step_<step>_tmp`` to ``step_<step>`` (replacing an older copy),
    then runs ``after_rename``. A write that fails on any rank (a full disk) raises
    :class:`CheckpointWriteError` on every rank, removes the partial directory and leaves the
    checkpoints saved before untouched. ``timer`` gets a ``checkpoint/<phase>`` span per phase.
    """
    rank = dist.get_rank()
    final = checkpoint_path(root, step)
    tmp = final.with_name(final.name + "_tmp")

    def start() -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

    def write_shards() -> None:
        plain_tensors(state)  # fp8: the master weights, not torchao's float8 wrappers
        dcp.save(state, checkpoint_id=str(tmp))
        if save_rng:
            torch.save(rng_state(), tmp / f"rng_state_rank_{rank}.pt")

    def finish() -> None:
        if rank != 0:
            return
        if base_model_dir is not None:
            copy_hf_meta(base_model_dir, tmp / HF_META_DIR)
        for name, content in (extra_files or {}).items():
            _check_extra_name(name)
            target = tmp / name
            target.write_bytes(content if isinstance(content, bytes) else content.encode())
        files = record_files(tmp, skip=META_FILE)
        full_meta = {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "backend": "fsdp",
            "world_size": dist.get_world_size(),
            "training_state": "optimizer" in state,
            **meta,
            FILES_KEY: {name: record.to_json() for name, record in files.items()},
        }
        _write_json_durably(tmp / META_FILE, full_meta)
        _replace_dir(tmp, final)
        fsync_dir(final.parent)

    def span(name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if timer is None else timer.span(f"checkpoint/{name}")

    for name, phase in (("mkdir", start), ("dcp_save", write_shards), ("finalize", finish)):
        with span(name):
            _on_every_rank(phase, root, final, tmp)
    if rank == 0 and after_rename is not None:
        with span("retention"):
            after_rename()
    with span("barrier"):
        dist.barrier()
    return final


def _on_every_rank(phase: Callable[[], None], root: str | Path, final: Path, tmp: Path) -> None:
    """Run one phase of a save on this rank. When it fails on any rank, every rank raises (none waits
    forever in the next collective); after a failed write (a full disk) rank 0 also removes the
    partial directory to give its space back."""
    own: Exception | None = None
    try:
        phase()
        failure = None
    except (OSError, CheckpointException) as err:
        failure = _os_cause(err)
    except Exception as err:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
        own = err
        failure = f"{type(err).__name__}: {err}"
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, (failure, own is None) if failure is not None else None)
    reported = [f for f in failures if f is not None]
    if not reported:
        return
    if own is not None:
        raise own
    message, write_failed = reported[0]
    if write_failed and dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    kept = latest_checkpoint(root)
    intact = (
        f"the newest checkpoint, {checkpoint_path(root, kept)}, is untouched"
        if kept is not None
        else "there is no earlier checkpoint"
    )
    raise CheckpointWriteError(
        f"could not write checkpoint {final}: {message}; {intact}. Free disk space or fix the "
        "permissions, then resume with `--resume_from_checkpoint true`"
    )


def _os_cause(err: BaseException) -> str:
    """``strerror (file)`` of the OS error behind a failed read or write, else the error's first line
    (DCP wraps every rank's error in one CheckpointException)."""
    if isinstance(err, CheckpointException):
        wrapped = [exc for exc, _ in err.failures.values()]
        err = next((e for e in wrapped if isinstance(e, OSError)), wrapped[0] if wrapped else err)
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror} ({err.filename})" if err.filename else err.strerror
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def load_checkpoint_state(path: str | Path, state: dict[str, Any], *, restore_rng: bool) -> None:
    """Fill ``state`` (a DCP skeleton with the entries to read) in place from ``path``; call on every rank.
    Float8-wrapped weights (fp8) are replaced by plain views of their master tensors first."""
    plain_tensors(state)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as err:
        raise CheckpointError(
            f"{path} could not be read ({_os_cause(err)}); it is damaged or was saved for "
            "another model: resume another step with `--resume_from_checkpoint N`"
        ) from None
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


# ---------------------------------------------------------------- what both trainers share
class CheckpointedTrainer:
    """The checkpoint methods the FSDP and Megatron trainers share. A trainer provides ``settings``
    (its ``checkpoint`` policy and ``model``), ``checkpoint_dir``, ``model_dir``, ``_step``,
    ``_checkpoint_state(training_state)`` (what to save), ``_checkpoint_meta()`` (its meta.json
    fields) and ``load_checkpoint(which)``."""

    def _require_checkpoint_dir(self) -> Path:
        if self.checkpoint_dir is None:
            raise ValueError("no checkpoint directory: set `checkpoint_dir` or `run_name` in the config")
        return self.checkpoint_dir

    def save_checkpoint(
        self,
        step: int | None = None,
        extra_files: Mapping[str, str | bytes] | None = None,
        timer: StepTimer | None = None,
    ) -> Path:
        """Save ``step_<step>`` (default: ``self.step``) atomically; call on every rank.

        With ``checkpoint_save_training_state`` the optimizer, LR scheduler and RNG states are
        included (exact resume); otherwise only weights. ``extra_files`` (name -> content, e.g. the
        orchestrator's ``orchestrator.json``) land in the directory before it becomes visible.
        Retention (``checkpoint_keep_last`` / ``checkpoint_keep_every``) runs after the rename.
        ``timer`` records the ``checkpoint/*`` spans (docs/metrics.md#checkpoint-spans).
        """
        root = self._require_checkpoint_dir()
        step = self._step if step is None else step
        policy = self.settings.checkpoint
        training_state = policy.checkpoint_save_training_state
        span = contextlib.nullcontext() if timer is None else timer.span("checkpoint/get_state_dict")
        with span:
            state = self._checkpoint_state(training_state)
        return save_checkpoint(
            root,
            step,
            state,
            meta=self._checkpoint_meta(),
            base_model_dir=self.model_dir,
            extra_files=extra_files,
            save_rng=training_state,
            after_rename=lambda: apply_retention(
                root, step, policy.checkpoint_keep_last, policy.checkpoint_keep_every
            ),
            timer=timer,
        )

    def _resumable(self, which: int | str | bool) -> tuple[int, Path, dict[str, Any]]:
        """(step, path, meta) of the checkpoint ``which`` names; one saved without its training state
        is refused."""
        root = self._require_checkpoint_dir()
        step = resolve_checkpoint_step(root, which)
        path = checkpoint_path(root, step)
        meta = read_meta(path)
        if not meta.get("training_state"):
            raise CheckpointError(
                f"{path} holds weights only (checkpoint_save_training_state was false) and "
                f"cannot be resumed; start a new run from it with `model: {path}`"
            )
        return step, path, meta

    def maybe_resume(self) -> int | None:
        """Apply ``resume_from_checkpoint`` (true = latest, N = step N); returns the loaded step or None."""
        which = self.settings.checkpoint.resume_from_checkpoint
        if which is False:
            return None
        return self.load_checkpoint(which)
