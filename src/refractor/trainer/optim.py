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


def build_optimizer(
    params: Iterable[torch.nn.Parameter], learning_rate: float, weight_decay: float, fused: bool = False
) -> torch.optim.AdamW:
    """AdamW with PyTorch's defaults (β = (0.9, 0.999), ε = 1e-8), as Telescope's FSDP backend uses."""
    return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, fused=fused or None)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, schedule: LRSchedule
) -> torch.optim.lr_scheduler.LambdaLR:
    # A LambdaLR even for "none": one code path, and its state (last_epoch) checkpoints uniformly.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=schedule)
