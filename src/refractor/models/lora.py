"""LoRA adapters on the shared model: ``y = x W^T + b + scale * dropout(x) A^T B^T``.

``add_lora`` turns the chosen projections of every decoder layer into ``LoRALinear``: the same
``nn.Linear`` (its ``weight`` and ``bias`` keep their HF names and are frozen) plus two small linears,
``lora_A`` ([rank, in]) and ``lora_B`` ([out, rank]), named as PEFT names them
(``...q_proj.lora_A.weight``), so an adapter folder converts name for name. ``scale = alpha / rank``.

``B`` starts at zero, so a fresh adapter leaves the model's outputs unchanged; ``A`` starts as PEFT's
``default`` (Kaiming-uniform with ``a = sqrt(5)``, as ``nn.Linear``) or ``gaussian`` (normal with
std ``1 / rank``).

``lora_modules_to_save`` (PEFT's ``modules_to_save``) trains the input embedding and / or the LM head
in full beside the adapters. Adapters alone cannot move what comes after the last decoder layer: the
logits are ``norm(h) E^T`` with the final norm and the head frozen, so however the adapters change
``h``, a token's logit stays within ``|norm weight| sqrt(hidden) |E_token|`` of zero. A pretrained head
has rows large enough for that not to bind; a random one (std 0.02) caps every token's probability at a
few percent. On a tied model the embedding is the head: naming either trains the one tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# the projections of a decoder layer that can carry an adapter, by the module that holds them
PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
ALL_PROJECTIONS = tuple(name for names in PROJECTIONS.values() for name in names)
LORA_INITS = ("default", "gaussian")
# the modules outside the decoder layers that can train in full beside the adapters
MODULES_TO_SAVE = ("embed_tokens", "lm_head")
# merged: servers get W + scale B A for every adapted weight; adapter: only A, B and the scale
LORA_SYNC_MODES = ("merged", "adapter")
# the one tensor of an adapter push that is not an adapter weight: ``scale`` as a float32 [1]
ADAPTER_SCALE_NAME = "lora.scale"


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA config keys (``lora_rank`` 0: no adapters, the whole model trains)."""

    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = ALL_PROJECTIONS
    lora_init: str = "default"  # default | gaussian
    lora_sync: str = "merged"  # merged | adapter (LORA_SYNC_MODES)
    lora_modules_to_save: tuple[str, ...] = ()  # of MODULES_TO_SAVE: trained in full (module doc)

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.lora_rank

    def check(self) -> None:
        """Raise ValueError naming the key of the first bad value."""
        unknown = sorted(set(self.lora_target_modules) - set(ALL_PROJECTIONS))
        if unknown:
            raise ValueError(
                f"lora_target_modules: {', '.join(unknown)} not in the decoder's projections "
                f"({', '.join(ALL_PROJECTIONS)})"
            )
        if self.enabled and not self.lora_target_modules:
            raise ValueError("lora_target_modules is empty: name at least one projection")
        if self.lora_init not in LORA_INITS:
            raise ValueError(f"lora_init must be one of {', '.join(LORA_INITS)}, got {self.lora_init!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_sync not in LORA_SYNC_MODES:
            raise ValueError(f"lora_sync must be one of {', '.join(LORA_SYNC_MODES)}, got {self.lora_sync!r}")
        if self.lora_sync == "adapter" and not self.enabled:
            raise ValueError("lora_sync: adapter needs lora_rank > 0")
        unknown = sorted(set(self.lora_modules_to_save) - set(MODULES_TO_SAVE))
        if unknown:
            raise ValueError(
                f"lora_modules_to_save: {', '.join(unknown)} not one of {', '.join(MODULES_TO_SAVE)}"
            )
        if self.lora_modules_to_save and not self.enabled:
            raise ValueError(
                "lora_modules_to_save needs lora_rank > 0 (without adapters the whole model trains)"
            )

    @property
    def pushes_adapters(self) -> bool:
        """Whether the weight sync sends the adapters alone (else the merged weights)."""
        return self.enabled and self.lora_sync == "adapter"


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` (frozen) with a trainable low-rank update (module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, dropout: float, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)  # take over base's parameters instead of allocating new ones
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=dtype)
        self.scale = scale
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        update = self.lora_B(self.lora_A(self.dropout(x).to(self.lora_A.weight.dtype)))
        return out + (self.scale * update).to(out.dtype)

    def merged_weight(self, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
        """``weight + scale * B A`` in float32 (any rows of ``weight`` with the same rows of ``B``)."""
        return merge_lora(weight, lora_a, lora_b, self.scale)


@torch.no_grad()
def merge_lora(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
) -> torch.Tensor:
    """A projection's weight with its adapter merged, ``weight + scale * B A``, in float32."""
    return weight.float() + scale * (lora_b.float() @ lora_a.float())


def init_adapter(module: LoRALinear, how: str, rank: int, generator: torch.Generator | None = None) -> None:
    with torch.no_grad():
        a = module.lora_A.weight
        if how == "gaussian":
            a.copy_(torch.randn(a.shape, generator=generator) / rank)
        else:  # nn.Linear's (and PEFT's default) Kaiming-uniform, a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))
            bound = 1.0 / math.sqrt(a.shape[1])
            a.copy_(torch.rand(a.shape, generator=generator) * 2 * bound - bound)
        module.lora_B.weight.zero_()


def add_lora(model: nn.Module, settings: LoraSettings, dtype: torch.dtype, seed: int = 0) -> int:
    """Adapters in ``dtype`` on ``settings.lora_target_modules`` of every decoder layer of ``model``
    (refractor's ``CausalLM``, or an HF causal LM whose decoder layers hold ``self_attn`` and ``mlp``
    with the same projection names, as HF's Llama-family models do); the modules of
    ``settings.lora_modules_to_save`` train in full, cast to ``dtype``; every other parameter is frozen.
    Returns the number of trained parameters. Seeded: every rank builds the same adapters."""
    settings.check()
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    count = 0
    for index, layer in enumerate(model.model.layers):
        for holder, names in PROJECTIONS.items():
            parent = getattr(layer, holder, None)
            for name in names:
                if name not in settings.lora_target_modules:
                    continue
                base = getattr(parent, name, None)
                if type(base) is not nn.Linear:
                    raise ValueError(
                        f"lora_target_modules: decoder layer {index} has no {holder}.{name} linear layer "
                        f"(its {holder} is {type(parent).__name__})"
                    )
                smallest = min(base.in_features, base.out_features)
                if settings.lora_rank > smallest:
                    raise ValueError(
                        f"lora_rank {settings.lora_rank} exceeds {holder}.{name}'s smaller dimension "
                        f"({smallest})"
                    )
                module = LoRALinear(base, settings.lora_rank, settings.scale, settings.lora_dropout, dtype)
                init_adapter(module, settings.lora_init, settings.lora_rank, generator)
                setattr(parent, name, module)
                count += module.lora_A.weight.numel() + module.lora_B.weight.numel()
    saved = {}  # by identity: a tied head and the embedding are one tensor
    for name in settings.lora_modules_to_save:
        weight = saved_weight(model, name)
        saved[id(weight)] = weight
    for weight in saved.values():
        weight.data = weight.data.to(dtype)
        weight.requires_grad_(True)
        count += weight.numel()
    return count


def saved_weight(model: nn.Module, module: str) -> nn.Parameter:
    """The weight of ``module`` (one of MODULES_TO_SAVE) of ``model``: a tied head is the embedding."""
    embedding = model.model.embed_tokens.weight
    if module == "embed_tokens":
        return embedding
    head = getattr(model, "lm_head", None)  # refractor's CausalLM has none when tied; HF's shares it
    return embedding if head is None else head.weight


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def is_adapter_update_name(name: str) -> bool:
    """A tensor of an adapter push: an adapter weight or the scale."""
    return name == ADAPTER_SCALE_NAME or is_adapter_name(name)


def adapter_target(name: str) -> str:
    """The projection an adapter weight belongs to: ``...self_attn.q_proj.lora_A.weight`` -> q_proj."""
    return name.rsplit(".lora_", 1)[0].rpartition(".")[2]


def describe_adapters(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> str:
    """The adapter weights among (name, shape) pairs as ``rank R on <projections>`` (R: A's rows)."""
    shapes = list(shapes)
    ranks = sorted({int(shape[0]) for name, shape in shapes if ".lora_A." in name and len(shape) == 2})
    targets = {adapter_target(name) for name, _ in shapes if is_adapter_name(name)}
    ordered = [t for t in ALL_PROJECTIONS if t in targets] + sorted(targets - set(ALL_PROJECTIONS))
    rank = "/".join(map(str, ranks)) or "?"
    return f"rank {rank} on {', '.join(ordered) or 'no projection'}"
