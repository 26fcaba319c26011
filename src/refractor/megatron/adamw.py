"""AdamW whose moments are stored in a lower precision (``megatron_exp_avg_dtype`` /
``megatron_exp_avg_sq_dtype``), as Megatron-Core's precision-aware optimizer stores them.

Between steps each moment is kept in its storage dtype; a step upcasts the stored moments to float32,
runs torch's AdamW update on them (the functional AdamW the FSDP trainer's ``ShardLocalAdamW`` runs,
the same kernel as with float32 moments), and stores the new moments back, rounded to nearest:

* float32: the state is torch's own, the update is torch's AdamW bit for bit;
* bfloat16: the float32 moment rounded to bfloat16 (relative error at most 2^-8 per step);
* float16: scaled per tensor first, as TransformerEngine's ``FusedAdam`` stores them: the stored
  tensor is ``moment / scale`` with ``scale = absmax / (65504 / 2)`` (a float32 scalar kept in the
  state as ``<moment>_scale``), so the largest element sits at half the float16 range and small
  second moments do not underflow; relative error at most 2^-11 for elements down to 2^-29 of the
  absmax (float16's normal range), more for smaller ones.

The parameter update of a step reads the float32 moments before they are rounded, so one step from a
given state is float32 AdamW; the rounding shows from the next step on. The parameters stepped are
float32 (the master weights); a gradient in another dtype (bf16 main grads) is upcast for the update.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from refractor.trainer.optim import adamw_group_step

MOMENTS = ("exp_avg", "exp_avg_sq")
MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLOAT16_RANGE = torch.finfo(torch.float16).max / 2.0


@dataclass(frozen=True)
class MomentDtypes:
    """Storage dtypes of AdamW's first and second moments."""

    exp_avg: torch.dtype = torch.float32
    exp_avg_sq: torch.dtype = torch.float32

    def of(self, moment: str) -> torch.dtype:
        return self.exp_avg if moment == "exp_avg" else self.exp_avg_sq

    @property
    def all_float32(self) -> bool:
        return self.exp_avg == self.exp_avg_sq == torch.float32


def store(moment: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the stored tensor, its float16 scale or None) of a float32 moment."""
    if dtype == torch.float32:
        return moment, None
    if dtype == torch.bfloat16:
        return moment.to(torch.bfloat16), None
    scale = (moment.abs().amax() / FLOAT16_RANGE).reshape(1)
    inverse = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
    return (moment * inverse).to(torch.float16), scale


def load(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The float32 moment of a stored one (the tensor itself when stored in float32)."""
    if stored.dtype == torch.float32:
        return stored
    upcast = stored.to(torch.float32)
    return upcast if scale is None else upcast.mul_(scale)


class PrecisionAdamW(torch.optim.AdamW):
    """torch's AdamW with its moments stored in ``dtypes`` between steps. The state of a parameter holds
    ``step``, ``exp_avg``, ``exp_avg_sq`` in their storage dtypes and, for a float16 moment,
    ``<moment>_scale``.

    A step runs torch's functional AdamW (fused when ``fused``) on all parameters at once when the
    moments and gradients are float32, and one parameter at a time otherwise, so that the float32
    copies of the moments and the gradient exist for one parameter at a time (AdamW being elementwise,
    the result is the same)."""

    def __init__(self, params, lr: float, weight_decay: float, dtypes: MomentDtypes, fused: bool):
        super().__init__(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
        self.dtypes = dtypes

    def zero_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state of a parameter not stepped yet (what torch's AdamW starts from)."""
        state = {"step": torch.zeros((), dtype=torch.float32, device=p.device)}
        for moment in MOMENTS:
            state[moment], scale = store(torch.zeros_like(p, dtype=torch.float32), self.dtypes.of(moment))
            if scale is not None:
                state[f"{moment}_scale"] = scale
        return state

    @torch.no_grad()
    def step(self, closure=None, grads: Mapping[torch.Tensor, torch.Tensor] | None = None):
        """One update of every parameter with a gradient: ``grads`` (parameter -> gradient in any float
        dtype, on the parameter's device) when given, else its ``.grad``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            pairs = [(p, p.grad if grads is None else grads.get(p)) for p in group["params"]]
            pairs = [(p, g) for p, g in pairs if g is not None]
            together = self.dtypes.all_float32 and all(g.dtype == p.dtype for p, g in pairs)
            for chunk in [pairs] if together else [[pair] for pair in pairs]:
                self._update(group, chunk)
        return loss

    def _update(self, group: dict, chunk: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not chunk:
            return
        states = []
        for p, _ in chunk:
            if not self.state[p]:
                self.state[p].update(self.zero_state(p))
            states.append(self.state[p])
        moments = {m: [load(s[m], s.get(f"{m}_scale")) for s in states] for m in MOMENTS}
        adamw_group_step(
            {**group, "amsgrad": False},
            [p for p, _ in chunk],
            [g.to(p.dtype) for p, g in chunk],
            moments["exp_avg"],
            moments["exp_avg_sq"],
            [s["step"] for s in states],
        )
        for state, *updated in zip(states, *moments.values(), strict=True):
            for moment, value in zip(MOMENTS, updated, strict=True):
                state[moment], scale = store(value, self.dtypes.of(moment))
                if scale is not None:
                    state[f"{moment}_scale"] = scale
