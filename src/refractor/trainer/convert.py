"""``refractor convert CHECKPOINT OUT``: a native (DCP) checkpoint -> a Hugging Face model directory.

Runs offline in one process (no process group): the DCP shards of every rank are read with
their stored shapes, the ``model.`` entries (already HF names) are cast to the export dtype and
written as ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``,
next to the base model's config, tokenizer and generation files kept in ``hf_meta/``.

A LoRA checkpoint holds only its adapters and the weights of ``lora_modules_to_save`` (trained in
full). By default the adapters are merged into the base model's weights (read from the base model
directory recorded in the checkpoint: ``W + (alpha / rank) B A``) and the trained weights replace the
base's; ``--adapter`` writes a PEFT adapter folder instead (``adapter_config.json`` and
``adapter_model.safetensors``, the trained weights as PEFT's ``modules_to_save``), which
``peft.PeftModel.from_pretrained`` loads on the base model.
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
    meta = read_meta(ckpt)  # raises a clear error for a directory that is not a checkpoint
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
    if meta.get("lora") is not None:
        weights = merge_adapters(weights, meta["lora"], _base_model_dir(meta))
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


def _base_model_dir(meta: dict[str, Any]) -> Path:
    """The base model directory a LoRA checkpoint was trained on."""
    from refractor.trainer.checkpoint import CheckpointError

    path = meta.get("base_model_path")
    if path and (Path(path) / "config.json").is_file():
        return Path(path)
    from refractor.hub import resolve_model_path

    try:
        return resolve_model_path(meta["base_model"])
    except Exception as err:  # noqa: BLE001 - named with the paths tried
        raise CheckpointError(
            f"the LoRA checkpoint's base model is not available: {path!r} has no config.json and "
            f"{meta.get('base_model')!r} does not resolve ({err})"
        ) from None


def merge_adapters(adapters: dict[str, Any], lora: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """The base model's weights with every adapter merged (float32 arithmetic, base dtype kept) and
    the weights trained in full (``adapters``' other tensors) in place of the base's."""
    from refractor.models.loading import iter_safetensors
    from refractor.models.lora import is_adapter_name, merge_lora

    scale = float(lora["lora_alpha"]) / int(lora["lora_rank"])
    merged = {}
    for name, weight in iter_safetensors(base_dir):
        stem = name.removesuffix(".weight")
        a, b = adapters.get(f"{stem}.lora_A.weight"), adapters.get(f"{stem}.lora_B.weight")
        if a is not None and b is not None:
            weight = merge_lora(weight, a, b, scale).to(weight.dtype)
        elif name in adapters:
            weight = adapters[name].to(weight.dtype)
        merged[name] = weight
    missing = {n.rsplit(".lora_", 1)[0] + ".weight" if is_adapter_name(n) else n for n in adapters} - set(
        merged
    )
    if missing:
        raise ValueError(f"{base_dir} lacks the weights the adapters apply to: {', '.join(sorted(missing))}")
    return merged


def export_adapter(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write a PEFT LoRA adapter folder for the LoRA checkpoint ``checkpoint`` into ``out``."""
    from safetensors.torch import save_file

    from refractor.trainer.checkpoint import HF_META_DIR, read_meta

    ckpt, out = Path(checkpoint), Path(out)
    meta = read_meta(ckpt)
    lora = meta.get("lora")
    if lora is None:
        raise ValueError(f"{ckpt} holds full weights, not LoRA adapters: convert it without --adapter")
    if (out / "adapter_config.json").exists() and not overwrite:
        raise FileExistsError(f"{out} already holds an adapter; pass --overwrite to replace it")
    adapters = read_checkpoint_weights(ckpt)
    tied = json.loads((ckpt / HF_META_DIR / "config.json").read_text()).get("tie_word_embeddings", False)
    saved = sorted(lora.get("lora_modules_to_save", ()))
    if tied and saved:
        # one tensor, saved under both names and kept tied on load (PEFT's ensure_weight_tying)
        saved = ["embed_tokens"]
        adapters["lm_head.weight"] = adapters["model.embed_tokens.weight"].clone()
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"base_model.model.{name}": t.contiguous() for name, t in adapters.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": meta.get("base_model_path") or meta.get("base_model"),
        "r": int(lora["lora_rank"]),
        "lora_alpha": float(lora["lora_alpha"]),
        "lora_dropout": float(lora["lora_dropout"]),
        "target_modules": sorted(lora["lora_target_modules"]),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": saved or None,
        "ensure_weight_tying": bool(tied and saved),
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
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
    adapter: bool = typer.Option(
        False, help="LoRA checkpoints: write a PEFT adapter folder instead of the merged model."
    ),
) -> None:
    """Convert a native checkpoint to an HF directory (safetensors + config + tokenizer); a LoRA
    checkpoint to the merged model, or with --adapter to a PEFT adapter folder."""
    from refractor.trainer.checkpoint import CheckpointError

    try:
        if adapter:
            path = export_adapter(checkpoint, out, overwrite=overwrite)
        else:
            path = export_hf(checkpoint, out, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite)
    except (CheckpointError, ValueError, FileExistsError) as err:
        typer.secho(f"error: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path}")
