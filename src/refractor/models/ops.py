"""The decoder's elementwise glue (RMSNorm, rotary, SiLU-gate) as swappable functions.

Eager by default (exact HF numerics, any device). ``enable_compiled_ops()`` swaps in
``torch.compile``-fused versions (one kernel each instead of 5-10): the inference engine turns
this on for CUDA decode, where a step is a few hundred tiny kernels and launch count, not
bandwidth, bounds the step time. Call sites use ``ops.<name>`` so the swap is seen everywhere.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in fp32, scale in the input dtype: the exact order HF uses (bf16 parity).
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim] (the rotate-half convention of HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys rotated together (one kernel for both where an implementation has one)."""
    return ops.apply_rotary(q, cos, sin), ops.apply_rotary(k, cos, sin)


EAGER = {"rms_norm": rms_norm, "apply_rotary": apply_rotary, "silu_mul": silu_mul, "rotary_qk": rotary_qk}
ops = SimpleNamespace(**EAGER)


def enable_compiled_ops(device: torch.device) -> bool:
    """Swap in fused versions and compile them now (dynamic shapes); False (eager kept) on failure."""
    # rotary_qk stays eager: it calls the compiled apply_rotary for q and for k
    compiled = {
        name: torch.compile(EAGER[name], dynamic=True) for name in ("rms_norm", "apply_rotary", "silu_mul")
    }
    try:
        x = torch.randn(5, 3, 8, device=device, dtype=torch.bfloat16)
        cs = torch.randn(5, 8, device=device, dtype=torch.bfloat16)
        compiled["rms_norm"](x, torch.ones(8, device=device, dtype=torch.bfloat16), 1e-6)
        compiled["apply_rotary"](x, cs, cs)
        compiled["silu_mul"](x, x)
    except Exception as err:  # no compiler / unsupported backend: eager is exact anyway
        log.warning("torch.compile of the decoder ops failed (%s); keeping eager ops", err)
        return False
    for name, fn in compiled.items():
        setattr(ops, name, fn)
    return True


def enable_liger_ops() -> bool:
    """Swap in Liger-Kernel's Triton RMSNorm, SiLU-gate and rotary (CUDA, ``liger-kernel`` installed).

    Their numerics follow HF's (fp32 normalization, input-dtype scale). False, and nothing swapped,
    when the package is missing.
    """
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.transformers.functional import liger_rms_norm, liger_swiglu
    except ImportError as err:
        log.warning("liger-kernel is not importable (%s); keeping the current ops", err)
        return False

    def liger_rotary_qk(q, k, cos, sin):
        # [T, heads, dim] seen as Liger's [1, heads, T, dim] (a transposed view, no copy) and back
        q4, k4 = (x.unsqueeze(0).transpose(1, 2) for x in (q, k))
        q4, k4 = LigerRopeFunction.apply(q4, k4, cos.unsqueeze(0), sin.unsqueeze(0))
        return q4.transpose(1, 2).squeeze(0), k4.transpose(1, 2).squeeze(0)

    ops.rms_norm = lambda x, weight, eps: liger_rms_norm(x, weight, eps, in_place=False)
    ops.silu_mul = liger_swiglu
    ops.rotary_qk = liger_rotary_qk
    return True


def disable_compiled_ops() -> None:
    for name, fn in EAGER.items():
        setattr(ops, name, fn)
