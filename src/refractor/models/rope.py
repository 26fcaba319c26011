"""Rotary position embeddings, computed from positions on the fly (no cached cos/sin tables).

Nothing here is module state: the inverse frequencies depend only on the config, so a model
built on the meta device (FSDP) or captured in a CUDA graph needs no buffer re-initialization.
The formulas follow the Hugging Face ones (``modeling_rope_utils``) so logits match transformers.
"""

from __future__ import annotations

import math

import torch

from refractor.models.config import ModelConfig


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / dim))


def rope_inv_freq(config: ModelConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] on CPU in fp32, cos/sin scaling factor).

    ``seq_len`` only matters for ``dynamic`` (NTK) scaling, whose base grows with the length.
    """
    p = config.rope
    dim = config.head_dim
    rope_type = p["rope_type"]
    base = float(p["rope_theta"])
    if rope_type == "default":
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, dim) / p["factor"], 1.0
    if rope_type == "dynamic":
        max_pos = config.max_position_embeddings
        seq_len = max(seq_len or max_pos, max_pos)
        factor = p["factor"]
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(base, dim, p), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, dim, p, config.max_position_embeddings)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _llama3_inv_freq(base: float, dim: int, p: dict) -> torch.Tensor:
    inv_freq = _base_inv_freq(base, dim)
    factor = p["factor"]
    low = p["low_freq_factor"]
    high = p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, p: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(beta_fast)
    high = correction_dim(beta_slow)
    if p.get("truncate", True):
        low = math.floor(low)
        high = math.ceil(high)
    low = max(low, 0)
    high = min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(torch.float) / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (
        1.0 / pos_freqs
    ) * extrapolation_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """Plain object (not a module) turning positions into (cos, sin) of shape [T, head_dim]."""

    def __init__(self, config: ModelConfig):
        self.config = config
        self.dynamic = config.rope["rope_type"] == "dynamic"
        self._inv_freq, self.scaling = rope_inv_freq(config)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        if self.dynamic:  # the base depends on the longest position: one host sync, eager only
            inv_freq, self.scaling = rope_inv_freq(self.config, int(positions.max()) + 1)
            return inv_freq.to(positions.device)
        cached = self._on_device.get(positions.device)
        if cached is None:  # cached per device so CUDA-graph capture never copies from the host
            cached = self._inv_freq.to(positions.device)
            self._on_device[positions.device] = cached
        return cached

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq(positions)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)
