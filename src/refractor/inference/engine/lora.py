"""Runtime LoRA for the native engine (``lora_sync: adapter``): every adapted projection computes
``y = base(x) + (x A^T) (scale B)^T`` over the base weights the engine loaded.

``EngineAdapters.attach`` allocates the adapter buffers once, at load, before the decode CUDA
graphs are captured, and swaps each adapted projection for a subclass that adds the update; an
adapter update (``LLMEngine.update_weights`` with the trainer's ``...q_proj.lora_A.weight`` names
and ``ADAPTER_SCALE_NAME``) copies into those buffers in place, so they keep their addresses and
the captured graphs stay valid. The scale is folded into B as it is written (one multiply per
update instead of one per step). Until the first update B is zero: the engine serves the base.
An engine without LoRA has no buffers and runs the plain projections (no extra work per step).
The buffers stay where they are while the engine sleeps (they are small beside the weights).

Fused projections (q/k/v as one GEMM, gate/up as one; ``layers.FusedLinear``) keep one GEMM pair
for their adapters too: the adapted parts' A's stacked on the rank dim ([parts * r, in]) and a
block-structured B ([out, parts * r]) whose block at (part i's output rows, its r columns) holds
part i's scale * B and zeros elsewhere (also the rows of a part without an adapter). So a fused
projection costs two extra GEMM launches whatever the number of parts, instead of two per part;
the zero blocks make B's GEMM ``parts`` times larger, which stays a fraction ``~ parts * r / in`` of
the base GEMM.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from refractor.models import CausalLM
from refractor.models.layers import FusedLinear
from refractor.models.lora import ADAPTER_SCALE_NAME, ALL_PROJECTIONS, describe_adapters


class LowRankUpdate(nn.Module):
    """The adapter buffers of one (possibly fused) projection; ``forward`` adds ``(x A^T) B^T``."""

    def __init__(self, in_features: int, out_features: int, parts: int, rank: int, like: torch.Tensor):
        super().__init__()
        # buffers, not parameters: the HF-named parameters stay the base weights alone
        self.register_buffer("a", like.new_zeros(parts * rank, in_features), persistent=False)
        self.register_buffer("b", like.new_zeros(out_features, parts * rank), persistent=False)

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.addmm_(F.linear(x, self.a), self.b.t())


class AdaptedLinear(nn.Linear):
    """A plain projection with a runtime adapter; it takes over the base's parameters (same names)."""

    def __init__(self, base: nn.Linear, update: LowRankUpdate):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_parameter("weight", base.weight)
        self.register_parameter("bias", base.bias)
        self.lora = update

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora(x, F.linear(x, self.weight, self.bias))


class AdaptedFusedLinear(FusedLinear):
    """A fused projection with a runtime adapter on some of its parts (module docstring)."""

    def __init__(self, base: FusedLinear, update: LowRankUpdate):
        nn.Module.__init__(self)
        self.register_parameter("weight", base.weight)
        self.register_parameter("bias", base.bias)
        self.split_sizes = base.split_sizes
        self.rows = base.rows
        self.lora = update

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.lora(x, F.linear(x, self.weight, self.bias)).split(self.split_sizes, dim=-1)


class EngineAdapters:
    """Every adapter buffer of the engine's model, addressed by the trainer's adapter names."""

    def __init__(self, rank: int, targets: tuple[str, ...]):
        self.rank = rank
        self.targets = tuple(t for t in ALL_PROJECTIONS if t in targets)
        # adapter name -> (buffer view it is written to, whether it is a B: written times the scale)
        self.slots: dict[str, tuple[torch.Tensor, bool]] = {}

    @classmethod
    def attach(cls, model: CausalLM, rank: int, targets: tuple[str, ...]) -> EngineAdapters:
        """Allocate the buffers of ``targets`` in every decoder layer of ``model`` (after fusion)."""
        adapters = cls(rank, targets)
        for layer in model.model.layers:
            found = set()
            for holder in ("self_attn", "mlp"):
                parent = getattr(layer, holder)
                for child_name, child in list(parent.named_children()):
                    if isinstance(child, AdaptedLinear | AdaptedFusedLinear):
                        raise ValueError(
                            f"{child_name} of layer {layer.layer_index} has runtime adapters already"
                        )
                    if isinstance(child, FusedLinear):
                        rows = {p: r for p, r in child.rows.items() if p in adapters.targets}
                    elif isinstance(child, nn.Linear) and child_name in adapters.targets:
                        rows = {child_name: slice(0, child.out_features)}
                    else:
                        continue
                    if rows:
                        prefix = f"model.layers.{layer.layer_index}.{holder}"
                        setattr(parent, child_name, adapters._adapt(child, rows, prefix))
                        found |= set(rows)
            missing = [t for t in adapters.targets if t not in found]
            if missing:
                raise ValueError(
                    f"LoRA targets {', '.join(missing)}: layer {layer.layer_index} has no such projection"
                )
        return adapters

    def _adapt(self, base: nn.Module, rows: dict[str, slice], prefix: str) -> nn.Module:
        weight = base.weight
        out_features, in_features = weight.shape
        r = self.rank
        for name, part in rows.items():
            smallest = min(in_features, part.stop - part.start)
            if r > smallest:
                raise ValueError(f"LoRA rank {r} exceeds {prefix}.{name}'s smaller dimension ({smallest})")
        update = LowRankUpdate(in_features, out_features, len(rows), r, weight.detach())
        for i, (name, part) in enumerate(rows.items()):
            cols = slice(i * r, (i + 1) * r)
            self.slots[f"{prefix}.{name}.lora_A.weight"] = (update.a[cols], False)
            self.slots[f"{prefix}.{name}.lora_B.weight"] = (update.b[part, cols], True)
        if isinstance(base, FusedLinear):
            return AdaptedFusedLinear(base, update)
        return AdaptedLinear(base, update)

    @property
    def names(self) -> list[str]:
        """Every name a complete adapter update writes."""
        return [*self.slots, ADAPTER_SCALE_NAME]

    def describe(self) -> str:
        return f"rank {self.rank} on {', '.join(self.targets)}"

    def plan(
        self, named: list[tuple[str, torch.Tensor]]
    ) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], list[str]]:
        """(name, buffer view, value) of each tensor of an adapter update, and what is wrong with it.

        Raises ValueError at once when the update's adapters are of another rank or on other
        projections than this engine's buffers, naming both.
        """
        sent = describe_update(named)
        if sent != self.describe():
            raise ValueError(
                f"the update's LoRA adapters ({sent}) do not fit this server's adapter buffers "
                f"({self.describe()}); start the servers with the run's lora_rank and lora_target_modules"
            )
        scales = [t for name, t in named if name == ADAPTER_SCALE_NAME]
        if len(scales) != 1 or scales[0].numel() != 1:
            raise ValueError(
                f"an adapter update carries its scale as one {ADAPTER_SCALE_NAME!r} of one value"
            )
        scale = float(scales[0].reshape(()))
        writes = []
        errors = [] if math.isfinite(scale) else [f"{ADAPTER_SCALE_NAME!r} is {scale}"]
        for name, tensor in named:
            if name == ADAPTER_SCALE_NAME:
                continue
            slot = self.slots.get(name)
            if slot is None:
                errors.append(f"{name!r} is not an adapter of this model")
                continue
            view, is_b = slot
            if tuple(tensor.shape) != tuple(view.shape):
                errors.append(f"{name!r} has shape {tuple(tensor.shape)}, expected {tuple(view.shape)}")
            else:
                writes.append((name, view, tensor.float() * scale if is_b else tensor))
        return writes, errors


def describe_update(named: list[tuple[str, torch.Tensor]]) -> str:
    """The shape of the adapter weights in ``named`` as ``rank R on <projections>`` (R: A's rows)."""
    return describe_adapters((name, tuple(t.shape)) for name, t in named)
