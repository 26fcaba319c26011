"""FP8 training (``fp8: true``): the decoder layers' projections run their GEMMs in float8 (torchao).

``convert_to_float8`` swaps the q/k/v/o and gate/up/down ``nn.Linear`` of every decoder layer for
torchao's ``Float8Linear`` (tensorwise dynamic scaling: e4m3 activations and weights, e5m2 gradients),
before FSDP2 shards the model. The embedding, the LM head and any linear whose dimensions are not
multiples of 16 (``torch._scaled_mm`` needs them) stay in the compute dtype.

What stays as without fp8: the master weights (``model_dtype``) are the same parameters under the
same names and shapes, so AdamW, checkpoints, export and the weight sync read them unchanged. Each
weight is wrapped in torchao's ``WeightWithDynamicFloat8CastTensor``: FSDP2 casts its shard to
float8 before the all-gather (half the bytes of a bf16 gather) and every other op sees the plain
tensor inside. ``after_optimizer_step`` computes all float8 weight scales in one all-reduce after
AdamW steps; without it each all-gather would reduce its own scale. Checkpoints hold the plain master
tensors (``plain_tensors``), so they load with or without fp8.

Only GPUs with FP8 tensor cores (compute capability >= 8.9: Hopper, Ada) run it: ``check_fp8``
refuses any other device with a message naming the key.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from refractor.errors import RefractorUserError

log = logging.getLogger(__name__)

MIN_CAPABILITY = (8, 9)
# HF names of the decoder layers' projections (Llama / Qwen2 / Qwen3, native or HF); a MoE router
# (``mlp.gate``) is not among them and keeps full precision
PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
_PRECOMPUTE = "_refractor_fp8_precompute_scales"


class FP8UnsupportedError(RefractorUserError, ValueError):
    """``fp8: true`` on a device or install that cannot run float8 GEMMs."""


def fp8_supported(device: str | torch.device) -> tuple[bool, str]:
    """(whether ``device`` can train in fp8, why not / what it is)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"this rank runs on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if (major, minor) < MIN_CAPABILITY:
        return False, f"this rank's GPU ({name}) has compute capability {major}.{minor}"
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        return False, f"torchao is not importable ({err}; `pip install torchao`)"
    return True, f"{name}, compute capability {major}.{minor}"


def check_fp8(device: str | torch.device) -> None:
    """Raise ``FP8UnsupportedError`` (a ValueError) unless ``device`` can train in fp8."""
    ok, reason = fp8_supported(device)
    if not ok:
        raise FP8UnsupportedError(
            "fp8: true needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9, Hopper/Ada) "
            f"and torchao; {reason}. Set `fp8: false` to train in the mixed_precision_dtype."
        )


def _is_fp8_projection(module: nn.Module, name: str) -> bool:
    # plain nn.Linear only: a subclass (a LoRA projection) has its own forward, which the swap would drop
    if type(module) is not nn.Linear or name.rsplit(".", 1)[-1] not in PROJECTIONS:
        return False
    out_features, in_features = module.weight.shape
    return out_features % 16 == 0 and in_features % 16 == 0


def convert_to_float8(model: nn.Module, *, precompute_scales: bool = True) -> int:
    """Swap the projections of ``model.layers`` (a ``PolicyModel``) for float8 training linears, in
    place and before ``fully_shard``; returns how many were swapped. Parameter names, shapes and
    dtypes stay as they were.

    ``precompute_scales``: ``after_optimizer_step`` computes the weight scales. Pass False when FSDP2
    offloads the parameters to host memory (``fsdp_cpu_offload``): each all-gather then casts a fresh
    GPU copy of the shard, which carries no precomputed scale, and computes its own."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    before = {name for name, m in model.layers.named_modules() if _is_fp8_projection(m, name)}
    if not before:
        raise FP8UnsupportedError(
            "fp8: true found no decoder projection whose dimensions are multiples of 16; "
            "this model cannot run float8 GEMMs (set `fp8: false`)"
        )
    convert_to_float8_training(model.layers, module_filter_fn=_is_fp8_projection, config=config)
    setattr(model, _PRECOMPUTE, precompute_scales)
    total = sum(1 for name, m in model.layers.named_modules() if name.rsplit(".", 1)[-1] in PROJECTIONS)
    log.info("fp8: %d of %d decoder projections run float8 GEMMs (torchao)", len(before), total)
    return len(before)


@torch.no_grad()
def after_optimizer_step(model: nn.Module) -> None:
    """Recompute the float8 scales of the updated weights in one all-reduce; call after every
    ``optimizer.step()`` (a scale left from older weights would clip the new ones). A no-op unless
    ``convert_to_float8`` ran with ``precompute_scales``."""
    if not getattr(model, _PRECOMPUTE, False):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def plain_tensors(state: dict[str, Any]) -> None:
    """Replace, in place in the nested dict ``state``, every float8-wrapped master weight by the plain
    tensor it wraps (a view of the same storage; a DTensor stays a DTensor with the same placements),
    so that DCP saves and loads plain tensors: checkpoints are the same with or without fp8."""
    if "torchao.float8" not in sys.modules:  # nothing can be wrapped
        return
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    def plain(t: torch.Tensor) -> torch.Tensor:
        local = t._local_tensor if isinstance(t, DTensor) else t
        if not isinstance(local, WeightWithDynamicFloat8CastTensor):
            return t
        inner = local._tensor.detach()
        if not isinstance(t, DTensor):
            return inner
        return DTensor.from_local(
            inner, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(items):
            if isinstance(value, torch.Tensor):
                node[key] = plain(value)
            elif isinstance(value, dict | list):
                walk(value)

    walk(state)
