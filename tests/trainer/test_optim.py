"""LR schedules against the table of docs/algorithms.md, written out independently here."""

from __future__ import annotations

import math

import pytest
import torch

from refractor.trainer.optim import LRSchedule, build_lr_scheduler, build_optimizer


def reference_multiplier(kind: str, s: int, w: int, t: int, rho: float) -> float:
    if kind == "none":
        return 1.0
    if kind == "constant":
        return 1.0 if w == 0 or s >= w else s / w
    if s < w:
        return s / max(w, 1)
    frac = min((s - w) / max(t - w, 1), 1.0)
    if kind == "linear":
        return 1.0 - (1.0 - rho) * frac
    return rho + (1.0 - rho) * 0.5 * (1.0 + math.cos(math.pi * frac))


@pytest.mark.parametrize("kind", ["none", "constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_schedule_matches_reference_table(kind, warmup):
    total = 10
    rho = 0.1
    sched = LRSchedule(kind, warmup, total, rho)
    for s in range(total + 3):  # past the horizon the multiplier stays at the floor
        assert sched(s) == pytest.approx(reference_multiplier(kind, s, warmup, total, rho), abs=1e-12), (
            kind,
            s,
        )


def test_scheduler_drives_adamw_lr_and_warmup_starts_at_zero():
    p = torch.nn.Parameter(torch.ones(2))
    opt = build_optimizer([p], learning_rate=0.5, weight_decay=0.0)
    sched = build_lr_scheduler(opt, LRSchedule("cosine", 2, 6, 0.2))
    seen = []
    for _ in range(7):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [0.5 * reference_multiplier("cosine", s, 2, 6, 0.2) for s in range(7)]
    assert seen == pytest.approx(expected)
    assert seen[0] == 0.0
    assert opt.defaults["betas"] == (0.9, 0.999) and opt.defaults["eps"] == 1e-8


def test_unknown_schedule_is_a_clear_error():
    with pytest.raises(ValueError, match="lr_scheduler"):
        LRSchedule("exponential", 0, 10, 0.0)(5)
