"""LoRA adapters on a vLLM server (``lora_sync: adapter``): the policy is the base the server loaded
plus one adapter, which every adapter push replaces.

vLLM 0.32 applies LoRA per request (the request's ``LoRARequest``) and loads an adapter from a PEFT
folder only. So a server is started with ``--enable-lora`` and one static adapter (``--lora-modules``)
named as the served model, the base staying reachable as ``<name>:base``; requests that name the
served model get the adapter, requests that name no model get the base. The adapter's folder is a
private temporary folder the launcher creates with a zero adapter (B = 0: the server serves the base
until the first push) and removes when the server stops.

Inside the server (``AdapterFolder``, run by the weight-transfer backend) an adapter push is checked
whole, the names and shapes against the folder's, then written into the folder, its tensors file
replaced atomically. vLLM's ``finish_weight_update`` drops every loaded adapter (base weights may have
changed under them), so the first step after the push loads the new file. The adapter keeps its name,
id and path from push to push: requests in flight during a push go on with the new adapter when they
resume, as with merged weights. vLLM keys prefix-cache blocks by the adapter's name and path, which do
not change, so the cache reset that ends every push is what keeps KV of an older adapter from being
reused.

The scale is folded into B when it is written (the folder's ``lora_alpha`` is its rank, so vLLM's
scaling is 1): the config file is written once, at start.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from refractor.inference.vllm.update_check import (
    ExpectedTensor,
    checkpoint_tensors,
    read_safetensors_header,
    served_checkpoint_folder,
)
from refractor.models.lora import ADAPTER_SCALE_NAME, ALL_PROJECTIONS, PROJECTIONS, describe_adapters

ADAPTER_DIR_ENV = "REFRACTOR_VLLM_ADAPTER_DIR"  # tells the server's workers where the adapter lives
BASE_NAME_SUFFIX = ":base"  # the base model's served name is the adapter's plus this
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM 0.32 takes
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PEFT's names: the HF name under this prefix

_HOLDERS = "|".join(PROJECTIONS)
_PROJECTION_WEIGHT = re.compile(
    rf"(?P<stem>.*\.layers\.(?P<layer>\d+)\.(?:{_HOLDERS})\.(?P<proj>\w+))\.weight"
)


def max_lora_rank(rank: int) -> int:
    """vLLM's ``--max-lora-rank`` for adapters of ``rank``: the smallest value it takes that fits."""
    fits = [r for r in VLLM_MAX_LORA_RANKS if r >= rank]
    if rank < 1 or not fits:
        raise ValueError(f"lora_rank {rank}: vLLM serves LoRA ranks 1 to {VLLM_MAX_LORA_RANKS[-1]}")
    return fits[0]


def adapter_shapes(
    checkpoint: dict[str, ExpectedTensor], rank: int, targets: tuple[str, ...]
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every adapter weight of ``rank`` on ``targets``, in every decoder layer of the
    checkpoint: ``<projection>.lora_A.weight`` [rank, in] and ``.lora_B.weight`` [out, rank].

    Raises ValueError naming a layer that lacks a target projection (a checkpoint that does not name
    its projections as Llama's do)."""
    shapes: dict[str, tuple[int, ...]] = {}
    found: dict[int, set[str]] = {}
    for name in sorted(checkpoint):
        match = _PROJECTION_WEIGHT.fullmatch(name)
        if match is None:
            continue
        found.setdefault(int(match["layer"]), set()).add(match["proj"])
        if match["proj"] not in targets:
            continue
        out_features, in_features = checkpoint[name].shape
        if rank > min(in_features, out_features):
            raise ValueError(
                f"lora_rank {rank} exceeds {name}'s smaller dimension ({min(checkpoint[name].shape)})"
            )
        shapes[f"{match['stem']}.lora_A.weight"] = (rank, in_features)
        shapes[f"{match['stem']}.lora_B.weight"] = (out_features, rank)
    if not found:
        raise ValueError(
            f"lora_target_modules: the checkpoint has no decoder projections named as Llama's "
            f"({', '.join(ALL_PROJECTIONS)}) to put the adapters on"
        )
    for layer, projections in sorted(found.items()):
        missing = [t for t in targets if t not in projections]
        if missing:
            raise ValueError(f"lora_target_modules: decoder layer {layer} has no {', '.join(missing)} weight")
    return shapes


def create_adapter_folder(model: str, rank: int, targets: tuple[str, ...]) -> Path:
    """A private temporary folder holding a zero adapter of ``rank`` on ``targets`` for ``model`` (a
    local checkpoint or one in the HF cache); the caller removes it when the server stops."""
    checkpoint_dir = served_checkpoint_folder(model, None, None)
    checkpoint = checkpoint_tensors(checkpoint_dir) if checkpoint_dir is not None else None
    if checkpoint is None:
        raise ValueError(
            f"`lora_sync: adapter` with vLLM needs {model!r} as a local safetensors checkpoint (the "
            "adapter's shapes are read from it)"
        )
    shapes = adapter_shapes(checkpoint, rank, targets)
    folder = Path(tempfile.mkdtemp(prefix="refractor-vllm-adapter-"))
    try:
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": rank,  # scaling 1: pushes write B times the run's scale
            "target_modules": [t for t in ALL_PROJECTIONS if t in targets],
            "bias": "none",
        }
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        write_adapter(folder, {name: torch.zeros(shape) for name, shape in shapes.items()})
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def write_adapter(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace the folder's tensors file (atomically: a load sees the old file or the new one)."""
    from safetensors.torch import save_file

    partial = folder / f".{WEIGHTS_FILE}.partial"
    save_file({PEFT_PREFIX + name: t.contiguous() for name, t in tensors.items()}, str(partial))
    os.replace(partial, folder / WEIGHTS_FILE)


class AdapterFolder:
    """The served adapter's folder, as the server's weight-transfer backend checks and writes it."""

    def __init__(self, folder: Path):
        self.folder = folder
        header = read_safetensors_header(folder / WEIGHTS_FILE)
        self.shapes = {name.removeprefix(PEFT_PREFIX): entry.shape for name, entry in header.items()}

    @classmethod
    def from_env(cls) -> AdapterFolder | None:
        """The folder the launcher named (None: the server serves no adapter)."""
        folder = os.environ.get(ADAPTER_DIR_ENV)
        return cls(Path(folder)) if folder else None

    @property
    def names(self) -> list[str]:
        """Every name a complete adapter push carries: the adapter weights and the scale."""
        return [*self.shapes, ADAPTER_SCALE_NAME]

    def describe(self) -> str:
        return describe_adapters(self.shapes.items())

    def plan(self, named: list[tuple[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The tensors to write for an adapter push (B times the scale) and what is wrong with it.

        Raises ValueError at once when the push's adapters are of another rank or on other
        projections than the served adapter, naming both."""
        sent = describe_adapters((name, tuple(t.shape)) for name, t in named)
        if sent != self.describe():
            raise ValueError(
                f"the update's LoRA adapters ({sent}) do not fit this server's adapter ({self.describe()}); "
                "start the servers with the run's lora_rank and lora_target_modules"
            )
        scales = [t for name, t in named if name == ADAPTER_SCALE_NAME]
        if len(scales) != 1 or scales[0].numel() != 1:
            raise ValueError(
                f"an adapter update carries its scale as one {ADAPTER_SCALE_NAME!r} of one value"
            )
        scale = float(scales[0].reshape(()))
        errors = [] if math.isfinite(scale) else [f"{ADAPTER_SCALE_NAME!r} is {scale}"]
        writes: dict[str, torch.Tensor] = {}
        for name, tensor in named:
            if name == ADAPTER_SCALE_NAME:
                continue
            shape = self.shapes.get(name)
            if shape is None:
                errors.append(f"{name!r} is not an adapter of this server")
            elif tuple(tensor.shape) != shape:
                errors.append(f"{name!r} has shape {tuple(tensor.shape)}, expected {shape}")
            elif not tensor.is_floating_point():
                errors.append(f"{name!r} has dtype {tensor.dtype}, expected a floating-point tensor")
            elif not torch.isfinite(tensor).all():
                errors.append(f"{name!r} holds non-finite values (NaN or Inf)")
            else:
                is_b = ".lora_B." in name
                writes[name] = (tensor.float() * scale).to(tensor.dtype) if is_b else tensor
        missing = sorted(set(self.shapes) - {name for name, _ in named})
        if missing:
            more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            errors.append(f"the update lacks adapter weights {', '.join(map(repr, missing[:4]))}{more}")
        return writes, errors

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        write_adapter(self.folder, tensors)
