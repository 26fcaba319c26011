"""What a weight update pushed into a vLLM server must look like before any of it is written.

The reference is the checkpoint the server loaded: every tensor name, shape and kind (floating or
not) is read from the safetensors headers of its files (the header only; no tensor data is read).
An update passes when each of its tensors is a tensor of that checkpoint with the same shape, is
floating-point where the checkpoint's is, and holds only finite values. A tied LM head
(``lm_head.weight`` with ``tie_word_embeddings``) is accepted although the checkpoint has no such
tensor, as the native engine does; vLLM's loader ignores it.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
TIED_LM_HEAD = "lm_head.weight"
_LISTED_PER_PROBLEM = 8  # names quoted per kind of problem; the rest are counted


@dataclass(frozen=True)
class ExpectedTensor:
    shape: tuple[int, ...]
    floating: bool


def read_safetensors_header(path: Path) -> dict[str, ExpectedTensor]:
    """Name -> expected tensor of one safetensors file (an 8-byte length, then a JSON header)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    # safetensors dtypes: F64/F32/F16/BF16/F8_*, I*, U*, BOOL
    return {
        name: ExpectedTensor(tuple(entry["shape"]), entry["dtype"].startswith(("F", "BF")))
        for name, entry in header.items()
    }


def checkpoint_tensors(folder: Path) -> dict[str, ExpectedTensor] | None:
    """Every tensor of the safetensors checkpoint in ``folder``; None when it has no safetensors file.

    With an index file, only the files it lists count (some repositories also ship a consolidated
    copy of the same weights under other names)."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    expected: dict[str, ExpectedTensor] = {}
    for file in files:
        expected.update(read_safetensors_header(file))
    return expected


def served_checkpoint_folder(model: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The local folder of the checkpoint vLLM loaded: the model path itself, or its snapshot in the
    Hugging Face cache (looked up offline); None when neither exists."""
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)
        )
    except Exception:  # noqa: BLE001 - not a cached repository: the caller warns and checks less
        return None


def expected_update_tensors(
    model: str, revision: str | None, download_dir: str | None, tied_lm_head_shape: tuple[int, int] | None
) -> dict[str, ExpectedTensor] | None:
    """The tensors an update may carry; None (with a warning) when no safetensors header is found."""
    folder = served_checkpoint_folder(model, revision, download_dir)
    expected = checkpoint_tensors(folder) if folder is not None else None
    if expected is None:
        logger.warning(
            "no safetensors checkpoint found for %r: weight updates are checked for floating dtypes "
            "and finite values only, not for names and shapes",
            model,
        )
        return None
    if tied_lm_head_shape is not None and TIED_LM_HEAD not in expected:
        expected[TIED_LM_HEAD] = ExpectedTensor(tied_lm_head_shape, True)
    return expected


def update_problems(
    tensors: list[tuple[str, torch.Tensor]], expected: dict[str, ExpectedTensor] | None
) -> list[str]:
    """What is wrong with an update, one entry per kind of problem (empty: it may be written).

    ``expected=None``: names and shapes are not checked. The finiteness check syncs the device once.
    """
    unknown: list[str] = []
    wrong_shape: list[str] = []
    wrong_kind: list[str] = []
    floating: list[tuple[str, torch.Tensor]] = []
    for name, tensor in tensors:
        want = expected.get(name) if expected is not None else ExpectedTensor(tuple(tensor.shape), True)
        if want is None:
            unknown.append(repr(name))
        elif tuple(tensor.shape) != want.shape:
            wrong_shape.append(f"{name!r} {tuple(tensor.shape)} (expected {want.shape})")
        elif tensor.is_floating_point() != want.floating:
            wrong_kind.append(f"{name!r} {tensor.dtype}")
        elif tensor.is_floating_point():
            floating.append((name, tensor))
    non_finite = []
    if floating:
        finite = torch.stack([torch.isfinite(t).all() for _, t in floating]).tolist()
        non_finite = [repr(name) for (name, _), ok in zip(floating, finite, strict=True) if not ok]
    problems = []
    for label, names in (
        ("not a tensor of the served checkpoint", unknown),
        ("wrong shape", wrong_shape),
        ("wrong kind of dtype (floating point vs integer)", wrong_kind),
        ("non-finite values (NaN or Inf)", non_finite),
    ):
        if names:
            more = len(names) - _LISTED_PER_PROBLEM
            listed = ", ".join(names[:_LISTED_PER_PROBLEM]) + (f" and {more} more" if more > 0 else "")
            problems.append(f"{label}: {listed}")
    return problems
