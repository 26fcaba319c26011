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


def _fsdp_pair():
    """Two identical FSDP2-sharded models (DTensor parameters on a 1-rank gloo mesh)."""
    from torch.distributed.fsdp import fully_shard

    from refractor.trainer.distributed import init_distributed

    init_distributed(device="cpu")
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3, bias=False))
        fully_shard(model[0])
        fully_shard(model)
        models.append(model)
    return models


@pytest.mark.parametrize("fused", [False, True])  # the fused kernel runs on the host too
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_shard_local_adamw_equals_stock_adamw_on_dtensors(weight_decay, fused):
    from torch.distributed.tensor import DTensor

    from refractor.trainer.optim import ShardLocalAdamW

    ours_model, stock_model = _fsdp_pair()
    assert all(isinstance(p, DTensor) for p in ours_model.parameters())
    ours = build_optimizer(ours_model.parameters(), 1e-2, weight_decay, fused=fused)
    assert isinstance(ours, ShardLocalAdamW)
    stock = torch.optim.AdamW(
        stock_model.parameters(), lr=1e-2, weight_decay=weight_decay, fused=fused or None
    )
    ours_sched = build_lr_scheduler(ours, LRSchedule("linear", 1, 5, 0.1))
    stock_sched = build_lr_scheduler(stock, LRSchedule("linear", 1, 5, 0.1))
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):  # the first step creates the state (stock path); the rest run on local shards
        x = torch.randn(7, 6, generator=gen)
        for model, optimizer, sched in ((ours_model, ours, ours_sched), (stock_model, stock, stock_sched)):
            model(x).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sched.step()
    assert ours._state_ready()  # steps 2-4 took the local-shard path
    for a, b in zip(ours_model.parameters(), stock_model.parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor())
    for pa, pb in zip(ours_model.parameters(), stock_model.parameters(), strict=True):
        sa, sb = ours.state[pa], stock.state[pb]
        assert set(sa) == set(sb) and torch.equal(sa["step"], sb["step"]) and sa["step"].item() == 4
        assert isinstance(sa["exp_avg"], DTensor)  # the stock layout: checkpoints see a plain AdamW
        assert torch.equal(sa["exp_avg_sq"].full_tensor(), sb["exp_avg_sq"].full_tensor())


def test_shard_local_adamw_skips_parameters_without_gradients():
    (model, _) = _fsdp_pair()
    optimizer = build_optimizer(model.parameters(), 1e-2, 0.0)
    for frozen_second in (False, True):
        model[2].weight.requires_grad_(not frozen_second)
        model(torch.ones(2, 6)).sum().backward()
        before = model[2].weight.full_tensor().clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert torch.equal(model[2].weight.full_tensor(), before) == frozen_second
