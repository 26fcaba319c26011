"""The config of ``refractor eval`` (docs/evals.md#standalone-evals) and the models it evaluates.

An eval config is a run config (``model``, ``evals``, inference and sampling keys, ``run_dir``,
``run_name``: the keys training reads, with the same defaults) plus the keys of
:class:`StandaloneEvalKeys`, which say *what* to evaluate:

* nothing: ``model`` itself (an HF id or directory, or a refractor checkpoint ``step_N``), at step 0
  (a checkpoint: its step);
* ``checkpoint_dir``: every checkpoint of a run (its ``checkpoints/`` folder, or the run folder),
  in step order; ``steps`` keeps only those steps;
* ``checkpoints``: explicit ``{path, step}`` entries (they win over discovered ones of the same step).

A refractor checkpoint (a DCP ``step_N`` directory with ``meta.json``) is converted to an HF
directory before its servers start; an HF directory (``config.json``) is served as it is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from refractor.config import ConfigError, RefractorConfig
from refractor.config.loader import build_config, parse_overrides, read_yaml_file
from refractor.errors import RefractorUserError

_STEP_DIR = re.compile(r"^step_(\d+)$")
NATIVE_MARKER = "meta.json"  # a refractor (DCP) checkpoint
HF_MARKER = "config.json"  # a Hugging Face model directory


class EvalTargetError(RefractorUserError, ValueError):
    """Nothing to evaluate, or a path that is no model; the message names the key."""


class CheckpointEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="A refractor checkpoint (step_N with meta.json) or an HF model directory.")
    step: int | None = Field(
        None,
        ge=0,
        description="Reported step; null: the version a checkpoint holds, N of an HF step_N, else 0.",
    )


class StandaloneEvalKeys(BaseModel):
    """The keys only ``refractor eval`` reads."""

    model_config = ConfigDict(extra="forbid")

    checkpoints: list[CheckpointEntry] = Field(default_factory=list, description="Explicit checkpoints.")
    checkpoint_dir: str | None = Field(
        None, description="A run folder or its checkpoints/ folder: evaluate every step_N in it."
    )
    steps: list[int] | None = Field(
        None, description="Only the checkpoints step_N with N in this list (of checkpoint_dir / checkpoints)."
    )
    max_concurrent_samples_per_server: int | None = Field(
        None,
        ge=1,
        description="Completions in flight per server; null: max_concurrent_prompts_per_server x group_size.",
    )
    # accepted so that an eval YAML written for the system refractor re-implements loads unchanged
    hf_weights: bool = Field(False, description="Ignored: checkpoints are recognized by their files.")
    wandb_run_path: str | None = Field(None, description="Ignored: results go to the run store.")


def load_eval_config(
    config_path: str | Path | None, overrides: list[str] | dict[str, Any] | None = None
) -> tuple[StandaloneEvalKeys, RefractorConfig]:
    """Split the file and the ``--key value`` overrides into the eval keys and the run config, and
    validate both (ConfigError naming every bad key)."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if config_path is not None:
        layers.append((str(config_path), read_yaml_file(config_path)))
    if overrides:
        parsed = overrides if isinstance(overrides, dict) else parse_overrides(list(overrides))
        layers.append(("command line", dict(parsed)))
    eval_keys: dict[str, Any] = {}
    run_layers = []
    for source, layer in layers:
        mine = {k: layer[k] for k in layer if k in StandaloneEvalKeys.model_fields}
        eval_keys.update(mine)
        run_layers.append((source, {k: v for k, v in layer.items() if k not in mine}))
    try:
        keys = StandaloneEvalKeys.model_validate(eval_keys)
    except ValidationError as err:
        lines = [f"`{'.'.join(map(str, e['loc']))}`: {e['msg']}" for e in err.errors()]
        raise ConfigError("\n".join(lines)) from None
    evals = next((layer["evals"] for _, layer in reversed(run_layers) if "evals" in layer), None)
    if not evals:
        raise ConfigError(
            "`evals` must list at least one eval, e.g. evals: [{name: math500, num_samples: 100}]"
        )
    if not any("environments" in layer for _, layer in run_layers):
        # training's rule (environments non-empty) holds for a run config; an eval trains on nothing
        first = evals[0]["name"] if isinstance(evals[0], dict) and "name" in evals[0] else "none"
        run_layers.insert(0, ("eval defaults", {"environments": [{"name": first}]}))
    return keys, build_config(run_layers)


@dataclass(frozen=True)
class EvalTarget:
    """One model to evaluate: the step its results are reported at and where its weights are."""

    step: int  # the policy version it holds: training reports its own evals of these weights there
    path: Path
    native: bool  # a refractor checkpoint, converted to an HF directory before serving
    dir_step: int | None = None  # N of a ``step_N`` directory (what ``steps`` selects)

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "hf_meta" if self.native else self.path


def _target(path: Path, step: int | None, key: str) -> EvalTarget:
    """``step`` None: a refractor checkpoint ``step_N`` (saved after N completed training steps)
    holds version N (``trainer_step`` in its meta.json); an HF directory ``step_N``: N; else 0."""
    native = (path / NATIVE_MARKER).is_file()
    if not native and not (path / HF_MARKER).is_file():
        raise EvalTargetError(
            f"`{key}`: {path} is neither a refractor checkpoint ({NATIVE_MARKER}) nor an HF model "
            f"directory ({HF_MARKER})"
        )
    m = _STEP_DIR.match(path.name)
    dir_step = int(m.group(1)) if m else None
    if step is None and native:
        try:
            meta = json.loads((path / NATIVE_MARKER).read_text())
            step = int(meta.get("trainer_step", int(meta.get("step", dir_step or 0)) + 1))
        except (ValueError, TypeError, AttributeError) as err:
            raise EvalTargetError(f"`{key}`: {path / NATIVE_MARKER} is damaged ({err})") from None
    elif step is None:
        step = dir_step or 0
    return EvalTarget(step, path, native, dir_step)


def discover(checkpoint_dir: str | Path) -> list[EvalTarget]:
    """Every ``step_N`` of a run's checkpoints folder (``<run>/checkpoints`` when given the run folder)."""
    root = Path(checkpoint_dir)
    if (root / "checkpoints").is_dir():
        root = root / "checkpoints"
    if not root.is_dir():
        raise EvalTargetError(f"`checkpoint_dir`: {checkpoint_dir} is not a directory")
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and ((child / NATIVE_MARKER).is_file() or (child / HF_MARKER).is_file()):
            found.append(_target(child, None, "checkpoint_dir"))
    return found


def model_target(model: str) -> EvalTarget:
    """``model`` as a target: a refractor checkpoint directory, else an HF id or directory."""
    if (Path(model).expanduser() / NATIVE_MARKER).is_file():
        return _target(Path(model).expanduser(), None, "model")
    from refractor.hub import ModelNotFoundError, resolve_model_path

    try:
        return _target(Path(resolve_model_path(model)), None, "model")
    except ModelNotFoundError as err:
        raise EvalTargetError(f"`model`: {err}") from None


def resolve_targets(keys: StandaloneEvalKeys, model: str) -> list[EvalTarget]:
    """The models to evaluate, in step order (one per step)."""
    by_step: dict[int, EvalTarget] = {}
    if keys.checkpoint_dir is not None:
        by_step |= {t.step: t for t in discover(keys.checkpoint_dir)}
        if not by_step:
            raise EvalTargetError(f"`checkpoint_dir`: no step_N checkpoint in {keys.checkpoint_dir}")
    for i, entry in enumerate(keys.checkpoints):
        target = _target(Path(entry.path), entry.step, f"checkpoints[{i}].path")
        by_step[target.step] = target
    if not by_step:
        target = model_target(model)
        by_step[target.step] = target
    if keys.steps is not None:
        found = {t.step if t.dir_step is None else t.dir_step: t for t in by_step.values()}
        missing = sorted(set(keys.steps) - set(found))
        if missing:
            raise EvalTargetError(
                f"`steps`: no checkpoint step_N for N in {missing} (found: {sorted(found)})"
            )
        by_step = {found[n].step: found[n] for n in keys.steps}
    return [by_step[s] for s in sorted(by_step)]
