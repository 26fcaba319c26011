"""Every loss branch against the independent float64 reference (values, gradients, metrics)."""

from __future__ import annotations

import math

import pytest
import torch

from refractor.algorithms import LossSettings, LossStats, loss_metrics, loss_normalizer, policy_loss
from refractor.config import load_config

from ._reference import RefSample, reference_loss

LENGTHS = [9, 13, 6, 11]
PAD = 5


def make_row(seed: int = 0, spread: float = 0.5, seq_shift: tuple[float, ...] = (0.0, -0.3, -0.3, -0.15)):
    """A packed row of 4 samples + padding, float64; logprobs vs rollout differ by ~spread."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for i, n in enumerate(LENGTHS):
        prompt = 2 + i % 2
        mask = [0] * prompt + [1] * (n - prompt)
        if n > 8:
            mask[prompt + 3] = 0  # an environment token inside the completion
        lp = -torch.rand(n, generator=g, dtype=torch.float64) * 3 - 0.05
        rollout = lp + spread * torch.randn(n, generator=g, dtype=torch.float64) + seq_shift[i]
        rollout = torch.where(torch.tensor(mask, dtype=torch.bool), rollout, torch.zeros_like(rollout))
        ref = lp + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
        adv = [1.3, -0.7, 0.4, -1.1][i]
        ent = torch.rand(n, generator=g, dtype=torch.float64) * 2
        parts.append((lp, rollout, ref, mask, adv, ent))
    pad_lp = torch.full((PAD,), -2.0, dtype=torch.float64)
    row = {
        "logprobs": torch.cat([p[0] for p in parts] + [pad_lp]),
        "rollout": torch.cat([p[1] for p in parts] + [torch.zeros(PAD, dtype=torch.float64)]),
        "ref": torch.cat([p[2] for p in parts] + [torch.zeros(PAD, dtype=torch.float64)]),
        "mask": torch.tensor(sum((p[3] for p in parts), []) + [0] * PAD, dtype=torch.float64),
        "adv": torch.tensor(sum(([p[4]] * len(p[3]) for p in parts), []) + [0.0] * PAD, dtype=torch.float64),
        "entropy": torch.cat([p[5] for p in parts] + [torch.ones(PAD, dtype=torch.float64)]),
        "doc": torch.tensor(sum(([i] * n for i, n in enumerate(LENGTHS)), []) + [-1] * PAD),
    }
    return row, parts


CASES = {
    "grpo": {},
    "rloo": {"algorithm": "rloo"},
    "dr_grpo_token_sum_norm": {"algorithm": "dr_grpo", "dr_grpo_loss_agg_mode": "token_sum_norm"},
    "ppo_clip": {"use_ppo_clip": True},
    "ppo_dual_clip": {"use_ppo_clip": True, "clip_ratio_c": 1.3},
    "cispo": {"algorithm": "cispo"},
    "cispo_dual_clip": {"algorithm": "cispo", "clip_ratio_c": 1.2},
    "gspo": {"algorithm": "gspo"},
    "gspo_dual_clip": {"algorithm": "gspo", "clip_ratio_c": 1.05},
    "sapo": {"algorithm": "sapo", "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05},
    "tis_truncate": {"use_tis": True, "tis_cap": 1.4, "tis_logprob_clamp": 20.0, "tis_mode": "truncate"},
    "tis_icepop": {
        "use_tis": True,
        "tis_cap": 1.3,
        "tis_floor": 0.8,
        "tis_logprob_clamp": 20.0,
        "tis_mode": "icepop",
    },
    "kl_k2": {"kl_penalty_tau": 0.3, "kl_estimator": "k2"},
    "kl_k3": {"kl_penalty_tau": 0.3, "kl_estimator": "k3"},
    "entropy_bonus": {"entropy_coef": 0.01},
    "seq_is_masking": {"seq_is_masking": True, "seq_is_mask_low": 0.85, "seq_is_mask_high": 1.35},
    "gspo_seq_is": {
        "algorithm": "gspo",
        "seq_is_masking": True,
        "seq_is_mask_low": 0.85,
        "seq_is_mask_high": 1.35,
    },
    "everything": {
        "use_ppo_clip": True,
        "clip_ratio_c": 1.3,
        "use_tis": True,
        "tis_cap": 1.5,
        "tis_logprob_clamp": 20.0,
        "tis_mode": "truncate",
        "kl_penalty_tau": 0.1,
        "kl_estimator": "k3",
        "entropy_coef": 0.02,
        "seq_is_masking": True,
        "seq_is_mask_low": 0.85,
        "seq_is_mask_high": 1.35,
    },
}


@pytest.mark.parametrize("use_batch_ref", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_loss_branch_matches_float64_reference(name, use_batch_ref):
    st = CASES[name]
    settings = LossSettings(**st)
    row, parts = make_row()
    n_tokens = int(row["mask"].sum())
    norm = loss_normalizer(n_tokens, len(parts), settings.aggregation, max_tokens=50)
    if settings.aggregation == "token_sum_norm":
        assert norm == len(parts) * 50
    else:
        assert norm == n_tokens

    lp = row["logprobs"].clone().requires_grad_()
    ent = row["entropy"].clone().requires_grad_()
    out = policy_loss(
        lp,
        row["rollout"],
        row["adv"],
        row["mask"],
        row["doc"],
        settings,
        norm,
        ref_logprobs=row["ref"] if use_batch_ref else None,
        entropy=ent,
    )
    out.loss.backward()

    ref_lp = [p[0].clone().requires_grad_() for p in parts]
    ref_ent = [p[5].clone().requires_grad_() for p in parts]
    samples = [
        RefSample(ref_lp[i], p[1], p[2] if use_batch_ref else p[1], p[3], p[4], ref_ent[i])
        for i, p in enumerate(parts)
    ]
    expected, m = reference_loss(samples, st, norm)
    expected.backward()

    torch.testing.assert_close(out.loss.detach(), expected.detach(), rtol=1e-12, atol=1e-12)
    grad_ref = torch.cat([t.grad for t in ref_lp] + [torch.zeros(PAD, dtype=torch.float64)])
    torch.testing.assert_close(lp.grad, grad_ref, rtol=1e-12, atol=1e-12)
    ent_grad = torch.cat(
        [t.grad if t.grad is not None else torch.zeros_like(t) for t in ref_ent]
        + [torch.zeros(PAD, dtype=torch.float64)]
    )
    torch.testing.assert_close(
        ent.grad if ent.grad is not None else torch.zeros_like(ent), ent_grad, rtol=1e-12, atol=1e-12
    )
    assert lp.grad.abs().sum() > 0  # the case is not degenerate

    stats = out.stats.as_dict()
    for key, value in m.items():
        assert stats[key] == pytest.approx(value, rel=1e-10, abs=1e-10), key
    metrics = loss_metrics(out.stats, settings)
    assert metrics["loss"] == pytest.approx(expected.item())
    assert metrics["entropy"] == pytest.approx(m["entropy_sum"] / m["num_tokens"])


def test_branches_are_exercised():
    """The fixed rows hit both sides of every clip, mask and bound the cases are about."""
    row, parts = make_row()
    settings = LossSettings(**CASES["everything"])
    out = policy_loss(
        row["logprobs"],
        row["rollout"],
        row["adv"],
        row["mask"],
        row["doc"],
        settings,
        float(row["mask"].sum()),
        entropy=row["entropy"],
    )
    metrics = loss_metrics(out.stats, settings)
    assert 0 < metrics["seq_is_masked_frac"] < 1
    assert 0 < metrics["dual_clip_frac"] < 1
    icepop = LossSettings(**CASES["tis_icepop"])
    out = policy_loss(row["logprobs"], row["rollout"], row["adv"], row["mask"], row["doc"], icepop, 1.0)
    assert 0 < loss_metrics(out.stats, icepop)["tis_zero_frac"] < 1
    cispo = LossSettings(**CASES["cispo_dual_clip"])
    out = policy_loss(row["logprobs"], row["rollout"], row["adv"], row["mask"], row["doc"], cispo, 1.0)
    assert 0 < loss_metrics(out.stats, cispo)["dual_clip_frac"] < 1


def test_sapo_gradient_by_finite_differences():
    row, _ = make_row(seed=3, spread=0.2)
    settings = LossSettings(algorithm="sapo", sapo_tau_pos=0.9, sapo_tau_neg=1.2)

    def f(lp):
        return policy_loss(lp, row["rollout"], row["adv"], row["mask"], row["doc"], settings, 17.0).loss

    assert torch.autograd.gradcheck(f, (row["logprobs"].clone().requires_grad_(),), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("clip_ratio_c", [None, 1.1])
def test_gspo_gradient_is_that_of_the_sequence_objective(clip_ratio_c):
    """GSPO's token gradient is d/d(lp) of sum_s f(S_s) / N, with S_s the sequence's mean log-ratio
    (f = clipped surrogate, dual-clipped): checked by central finite differences of that objective.
    (Its forward value, as in Telescope, repeats f(S_s) on each of the n_s tokens.)"""
    row, parts = make_row(seed=3, spread=0.2)
    lo = 0.8
    hi = 1.25
    settings = LossSettings(algorithm="gspo", clip_low=0.2, clip_high=0.25, clip_ratio_c=clip_ratio_c)
    norm = 17.0

    def sequence_objective(lp: torch.Tensor) -> float:
        total = 0.0
        start = 0
        for p in parts:
            n = len(p[3])
            m = torch.tensor(p[3], dtype=torch.float64)
            S = float(((lp[start : start + n] - p[1]) * m).sum() / m.sum())
            R = math.exp(S)
            A = p[4]
            f = max(-R * A, -min(max(R, lo), hi) * A)
            if clip_ratio_c is not None:
                f = min(f, clip_ratio_c * abs(A))
            total += f
            start += n
        return total / norm

    lp = row["logprobs"].clone().requires_grad_()
    policy_loss(lp, row["rollout"], row["adv"], row["mask"], row["doc"], settings, norm).loss.backward()
    eps = 1e-6
    numeric = torch.zeros_like(lp)
    for i in range(lp.numel()):
        e = torch.zeros_like(lp)
        e[i] = eps
        numeric[i] = (sequence_objective(row["logprobs"] + e) - sequence_objective(row["logprobs"] - e)) / (
            2 * eps
        )
    torch.testing.assert_close(lp.grad, numeric, rtol=1e-6, atol=1e-9)
    assert lp.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "name", ["grpo", "ppo_clip", "cispo", "gspo", "sapo", "everything", "tis_icepop", "kl_k2"]
)
def test_on_policy_first_step(name):
    """Rollout log-probs equal to the trainer's: ratios are 1, TIS weights 1, KL 0, gradient -A/N."""
    st = dict(CASES[name])
    st.pop("entropy_coef", None)
    settings = LossSettings(**st)
    row, _ = make_row()
    lp32 = row["logprobs"].float()
    rollout = torch.where(row["mask"] > 0, lp32, torch.zeros_like(lp32))
    lp = torch.where(row["mask"] > 0, lp32, torch.zeros_like(lp32)).clone().requires_grad_()
    norm = float(row["mask"].sum())
    out = policy_loss(lp, rollout, row["adv"].float(), row["mask"].float(), row["doc"], settings, norm)
    out.loss.backward()
    stats = out.stats.as_dict()
    assert stats["kl_inference_sum"] == 0.0 and stats["kl_penalty_sum"] == 0.0
    assert stats["tis_sum"] == stats["policy_tokens"] == stats["num_tokens"]  # every weight exactly 1
    assert stats["dual_clip_count"] == 0.0
    expected_grad = -row["adv"].float() * row["mask"].float() / norm
    if name == "gspo":  # sequence-level: each token carries 1/n_s of its sequence's gradient
        n_s = torch.tensor(
            [
                sum(m for m, d2 in zip(row["mask"].tolist(), row["doc"].tolist(), strict=True) if d2 == d)
                for d in row["doc"].tolist()
            ],
            dtype=torch.float32,
        )
        expected_grad = expected_grad / n_s.clamp(min=1)
    torch.testing.assert_close(lp.grad, expected_grad, rtol=1e-6, atol=1e-7)
    if name in ("ppo_clip", "gspo", "everything"):
        # ratio exactly 1 => the surrogate equals -A on every trainable token
        assert out.loss.item() == pytest.approx(float(-(row["adv"] * row["mask"]).sum() / norm), rel=1e-6)


def test_stats_add_and_metric_names():
    settings = LossSettings(
        use_tis=True,
        tis_mode="icepop",
        tis_floor=0.5,
        clip_ratio_c=2.0,
        use_ppo_clip=True,
        kl_penalty_tau=0.1,
        entropy_coef=0.1,
        seq_is_masking=True,
    )
    row, _ = make_row()
    out = policy_loss(
        row["logprobs"],
        row["rollout"],
        row["adv"],
        row["mask"],
        row["doc"],
        settings,
        10.0,
        entropy=row["entropy"],
    )
    total = LossStats.zeros() + out.stats + out.stats
    metrics = loss_metrics(total, settings)
    assert set(metrics) == {
        "loss",
        "entropy",
        "kl_divergence_inference",
        "num_tokens",
        "seq_is_masked_frac",
        "tis_mean",
        "tis_zero_frac",
        "dual_clip_frac",
        "kl_penalty",
        "entropy_bonus",
    }
    assert metrics["num_tokens"] == 2 * float(row["mask"].sum())
    assert metrics["entropy_bonus"] == pytest.approx(0.1 * metrics["entropy"])
    assert set(loss_metrics(total, LossSettings())) == {
        "loss",
        "entropy",
        "kl_divergence_inference",
        "num_tokens",
    }


def test_entropy_required_for_bonus():
    row, _ = make_row()
    with pytest.raises(ValueError, match="entropy_coef"):
        policy_loss(
            row["logprobs"],
            row["rollout"],
            row["adv"],
            row["mask"],
            row["doc"],
            LossSettings(entropy_coef=0.1),
            1.0,
        )


def test_settings_from_config():
    cfg = load_config(
        None,
        {
            "environments": [{"name": "countdown"}],
            "algorithm": "dr_grpo",
            "dr_grpo_loss_agg_mode": "token_sum_norm",
            "max_tokens": 100,
            "max_model_len": 200,
        },
    )
    s = LossSettings.from_config(cfg)
    assert s.algorithm == "dr_grpo" and s.aggregation == "token_sum_norm" and s.max_tokens == 100
    assert loss_normalizer(1234, 8, s.aggregation, s.max_tokens) == 800.0
    assert loss_normalizer(0, 0, "token_mean", 1) == 1.0
