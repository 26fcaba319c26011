"""Build the native model from an HF checkpoint directory (local path or the HF cache), offline.

Paths resolve through ``refractor.hub.resolve_model_path`` (local dir, HF cache,
``refractor-testing/...``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from refractor.hub import resolve_model_path
from refractor.models.config import ModelConfig
from refractor.models.model import CausalLM


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    with open(resolve_model_path(str(path)) / "config.json") as f:
        return json.load(f)


def build_model(
    hf_config: Any, dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> CausalLM:
    """An uninitialized-by-checkpoint model (torch's default init) from an HF config.

    Friendly to meta-device construction: ``with torch.device("meta"): build_model(cfg)``,
    then ``to_empty`` + ``init_weights()`` or a state-dict load. There are no buffers.
    """
    config = ModelConfig.from_hf(hf_config)
    if device is None and dtype is None:
        return CausalLM(config)
    with torch.device(device or "cpu"):
        model = CausalLM(config)
    return model.to(dtype) if dtype is not None else model


def iter_safetensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the checkpoint's safetensors files, on CPU."""
    from safetensors import safe_open

    root = resolve_model_path(str(path))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{root} has no *.safetensors files (only safetensors checkpoints load natively)"
        )
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


def load_model(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> CausalLM:
    """Read ``config.json`` + safetensors into a ``CausalLM`` on ``device`` in ``dtype`` (eval mode)."""
    root = resolve_model_path(str(path))
    with torch.device("meta"):
        model = build_model(read_hf_config(root))
    wanted = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    for name, tensor in iter_safetensors(root):
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the embedding is the head
        if name not in wanted:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints saved rope buffers; we recompute them
            raise ValueError(f"{root}: unexpected tensor {name!r} for {model.config.architecture}")
        if tuple(tensor.shape) != tuple(wanted[name].shape):
            raise ValueError(
                f"{root}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(wanted[name].shape)}"
            )
        loaded[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(wanted) - set(loaded))
    if missing:
        raise ValueError(f"{root}: checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    model.load_state_dict(loaded, strict=True, assign=True)
    return model.eval()
