"""AdamW and the learning-rate schedules (``W`` warmup, ``T`` horizon, ``ρ`` floor); docs/algorithms.md.

| lr_scheduler | multiplier at scheduler step s |
| none         | 1 |
| constant     | s/W for s < W, then 1 (1 everywhere when W == 0) |
| linear       | s/max(W,1) for s < W, else 1 - (1-ρ)·min((s-W)/max(T-W,1), 1) |
| cosine       | s/max(W,1) for s < W, else ρ + (1-ρ)·½(1 + cos(π·min((s-W)/max(T-W,1), 1))) |

With warmup the first step runs at LR 0. The scheduler steps once per training step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as functional_adamw


@dataclass(frozen=True)
class LRSchedule:
    kind: str  # none | constant | linear | cosine
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float

    def __call__(self, s: int) -> float:
        w = self.warmup_steps
        t = self.total_steps
        rho = self.min_lr_ratio
        if self.kind == "none" or (self.kind == "constant" and w == 0):
            return 1.0
        if s < w:
            return s / max(w, 1)
        if self.kind == "constant":
            return 1.0
        progress = min((s - w) / max(t - w, 1), 1.0)
        if self.kind == "linear":
            return 1.0 - (1.0 - rho) * progress
        if self.kind == "cosine":
            return rho + (1.0 - rho) * 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"unknown lr_scheduler {self.kind!r}; expected none, constant, linear or cosine")


def adamw_group_step(group: dict, params, grads, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs=()) -> None:
    """torch's functional AdamW over plain tensors with one param group's settings (``group``)."""
    beta1, beta2 = group["betas"]
    functional_adamw(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        list(max_exp_avg_sqs),
        list(steps),
        foreach=group["foreach"],
        capturable=group["capturable"],
        differentiable=group["differentiable"],
        fused=group["fused"],
        amsgrad=group["amsgrad"],
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
    )


class ShardLocalAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` that updates DTensor parameters through their local shards.

    AdamW is elementwise, so on parameters sharded (or replicated) over a mesh, running the update on
    each rank's local tensors gives exactly the update of the global tensors. The stock step on
    DTensors pays DTensor dispatch for every parameter (sharding propagation of each fused op), host
    time that a small model's GPU waits for; this step hands the local tensors to the same functional
    AdamW (``torch.optim.adamw.adamw``, fused on CUDA) in one call. State keeps the stock layout (DTensor
    moments, a step counter per parameter), so checkpoints and ``get_state_dict`` see a plain AdamW.
    A step that creates the state (the first, or DCP's own initialization) runs the stock step.
    """

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None or not self._state_ready():
            return super().step(closure)
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                params.append(_local(p))
                grads.append(_local(p.grad))
                exp_avgs.append(_local(state["exp_avg"]))
                exp_avg_sqs.append(_local(state["exp_avg_sq"]))
                if group["amsgrad"]:
                    max_exp_avg_sqs.append(_local(state["max_exp_avg_sq"]))
                steps.append(state["step"])
            if not params:
                continue
            adamw_group_step(group, params, grads, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs)
        return None

    def _state_ready(self) -> bool:
        """Every parameter with a gradient has its state, and no gradient is partial (a local shard of
        a pending sum, which only the stock step's DTensor dispatch would reduce)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if "exp_avg" not in self.state.get(p, {}):
                    return False
                if any(pl.is_partial() for pl in getattr(p.grad, "placements", ())):
                    return False
        return True


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def build_optimizer(
    params: Iterable[torch.nn.Parameter], learning_rate: float, weight_decay: float, fused: bool = False
) -> torch.optim.AdamW:
    """AdamW with PyTorch's defaults (β = (0.9, 0.999), ε = 1e-8), as Telescope's FSDP backend uses,
    stepping on local shards (``ShardLocalAdamW``)."""
    return ShardLocalAdamW(params, lr=learning_rate, weight_decay=weight_decay, fused=fused or None)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, schedule: LRSchedule
) -> torch.optim.lr_scheduler.LambdaLR:
    # A LambdaLR even for "none": one code path, and its state (last_epoch) checkpoints uniformly.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=schedule)
