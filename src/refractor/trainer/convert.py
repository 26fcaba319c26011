"""``refractor convert CHECKPOINT OUT``: a native (DCP) checkpoint -> a Hugging Face model directory.

Runs offline in one process (no process group): the DCP shards of every rank are read with
their stored shapes, the ``model.`` entries (already HF names) are cast to the export dtype and
written as ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``,
next to the base model's config, tokenizer and generation files kept in ``hf_meta/``.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import typer

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"5GB"`` / ``"500MB"`` / ``"1024"`` -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"max shard size {text!r} is not a size like 5GB, 500MB or 1000000")
    scale = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "M": 2**20, "MB": 2**20, "G": 2**30, "GB": 2**30}
    return int(float(m.group(1)) * scale[m.group(2).upper()])


def read_checkpoint_weights(checkpoint: str | Path) -> dict[str, Any]:
    """HF name -> full tensor (stored dtype) for every ``model.*`` entry of a DCP checkpoint."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(checkpoint))
    metadata = reader.read_metadata()
    weights = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            weights[key[len("model.") :]] = torch.empty(item.size, dtype=item.properties.dtype)
    if not weights:
        raise ValueError(f"{checkpoint}: the checkpoint holds no model weights")
    with warnings.catch_warnings():  # "no process group, assuming one process": exactly the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": weights}, storage_reader=reader, no_dist=True)
    return weights


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: str = "auto",
    max_shard_size: str = "5GB",
    overwrite: bool = False,
) -> Path:
    """Write an HF directory for ``checkpoint`` (a ``step_<N>`` directory) into ``out``; returns ``out``."""
    import torch
    from safetensors.torch import save_file

    from refractor.trainer.checkpoint import HF_META_DIR, CheckpointError, checkpoint_damage, read_meta

    ckpt = Path(checkpoint)
    out = Path(out)
    read_meta(ckpt)  # raises a clear error for a directory that is not a checkpoint
    damage = checkpoint_damage(ckpt, checksums=False)
    if damage is not None:
        raise CheckpointError(f"{ckpt} cannot be converted: {damage}")
    hf_meta = ckpt / HF_META_DIR
    if not (hf_meta / "config.json").is_file():
        raise ValueError(f"{ckpt} has no {HF_META_DIR}/config.json (saved without the base model's files)")
    if (out / "config.json").exists() and not overwrite:
        raise FileExistsError(f"{out} already holds a model (config.json); pass --overwrite to replace it")
    config = json.loads((hf_meta / "config.json").read_text())
    if dtype == "auto":
        name = config.get("dtype") or config.get("torch_dtype") or "float32"
    else:
        name = _DTYPES.get(dtype.lower())
    if name not in _DTYPES.values():
        raise ValueError(f"unsupported export dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    target = getattr(torch, name)

    weights = read_checkpoint_weights(ckpt)
    if config.get("tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # the embedding is the head; HF re-ties on load
    weights = {k: (v.to(target) if v.is_floating_point() else v).contiguous() for k, v in weights.items()}

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    shards = _split_shards(weights, parse_size(max_shard_size))
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for f in hf_meta.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    for key in ("dtype", "torch_dtype"):
        if key in config or (key == "torch_dtype" and "dtype" not in config):
            config[key] = name
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _split_shards(weights: dict[str, Any], max_bytes: int) -> list[dict[str, Any]]:
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def convert_command(
    checkpoint: str = typer.Argument(..., help="A checkpoint directory, e.g. runs/x/checkpoints/step_50."),
    out: str = typer.Argument(..., help="Output directory for the Hugging Face model."),
    dtype: str = typer.Option("auto", help="auto (the base model's dtype), float32, bfloat16 or float16."),
    max_shard_size: str = typer.Option(
        "5GB", help="Largest safetensors file; bigger models are split with an index."
    ),
    overwrite: bool = typer.Option(False, help="Replace a model already in OUT."),
) -> None:
    """Convert a native checkpoint to an HF directory (safetensors + config + tokenizer)."""
    from refractor.trainer.checkpoint import CheckpointError

    try:
        path = export_hf(checkpoint, out, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite)
    except (CheckpointError, ValueError, FileExistsError) as err:
        typer.secho(f"error: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path}")
