"""Independent float64 reference of the policy loss, written from docs/algorithms.md#policy-loss
sample by sample.

It does not import the code under test: one Python loop over samples, one over tokens' formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class RefSample:
    logprobs: torch.Tensor  # [n] float64, requires grad (trainer policy)
    rollout: torch.Tensor  # [n] float64
    ref: torch.Tensor  # [n] float64 (ratio reference)
    mask: list[int]
    advantage: float
    entropy: torch.Tensor | None = None  # [n] float64


def _clip(x, lo, hi):
    return torch.clamp(x, lo, hi)


def reference_loss(samples: list[RefSample], st: dict, normalizer: float) -> tuple[torch.Tensor, dict]:
    """Sum over samples of sum_t P_t m_t, divided by ``normalizer``; plus token-sum metrics."""
    total = torch.zeros((), dtype=torch.float64)
    m_tis = 0.0
    m_kl = 0.0
    m_dual = 0.0
    m_kept = 0.0
    m_n = 0.0
    m_ent = 0.0
    m_kli = 0.0
    lo = 1 - st.get("clip_low", 0.4)
    hi = 1 + st.get("clip_high", 0.5)
    c = st.get("clip_ratio_c")
    alg = st.get("algorithm", "grpo")
    for s in samples:
        lp = s.logprobs
        A = s.advantage
        n = lp.shape[0]
        big_delta = lp - s.rollout
        small_delta = lp - s.ref
        mask = torch.tensor(s.mask, dtype=torch.float64)
        m_n += float(mask.sum())
        with torch.no_grad():
            m_kli += float(((torch.exp(big_delta) - 1 - big_delta) * mask).sum())
            if s.entropy is not None:
                m_ent += float((s.entropy * mask).sum())
        if st.get("seq_is_masking"):
            cnt = max(float(mask.sum()), 1.0)
            g = math.exp(max(min(float((big_delta.detach() * mask).sum()) / cnt, 20), -20))
            if not (st["seq_is_mask_low"] <= g <= st["seq_is_mask_high"]):
                mask = torch.zeros(n, dtype=torch.float64)
        rho = torch.exp(torch.clamp(small_delta, -20, 20))
        dual = torch.zeros(n, dtype=torch.float64)
        if alg == "cispo":
            w = _clip(rho.detach(), lo, hi)
            if c is not None and A < 0:
                dual = (w > c).double()
                w = torch.clamp(w, max=c)
            P = -w * lp * A
        elif alg == "gspo":
            ns = max(float(mask.sum()), 1.0)
            S = float((small_delta.detach() * mask).sum()) / ns
            lam = small_delta / ns - (small_delta / ns).detach() + S
            R = torch.exp(torch.clamp(lam, max=10))
            P = torch.maximum(-R * A, -_clip(R, lo, hi) * A)
        elif alg == "sapo":
            tau = st["sapo_tau_pos"] if A > 0 else st["sapo_tau_neg"]
            P = -torch.sigmoid(tau * (rho - 1)) * (4 / tau) * A
        elif st.get("use_ppo_clip"):
            P = torch.maximum(-rho * A, -_clip(rho, lo, hi) * A)
        else:
            P = -lp * A
        if c is not None and alg != "cispo":
            dual = (c * abs(A) < P).double()
            P = torch.clamp(P, max=c * abs(A))
        tis = torch.ones(n, dtype=torch.float64)
        if st.get("use_tis"):
            d = torch.clamp(big_delta.detach(), -st["tis_logprob_clamp"], st["tis_logprob_clamp"])
            raw = torch.exp(d)
            if st.get("tis_mode") == "icepop":
                tis = torch.where(
                    (raw >= st["tis_floor"]) & (raw <= st["tis_cap"]), raw, torch.zeros_like(raw)
                )
            else:
                tis = torch.clamp(raw, max=st["tis_cap"])
            P = P * tis
        kl = torch.zeros(n, dtype=torch.float64)
        if st.get("kl_penalty_tau", 0) > 0:
            if st.get("kl_estimator") == "k3":
                dd = torch.clamp(big_delta, -20, 20)
                kl = torch.clamp(torch.exp(-dd) - 1 + dd, max=10)
            else:
                kl = big_delta**2
            P = P + st["kl_penalty_tau"] * kl
        if st.get("entropy_coef", 0) > 0:
            P = P - st["entropy_coef"] * s.entropy
        total = total + (P * mask).sum()
        m_kept += float(mask.sum())
        m_tis += float((tis * mask).sum())
        m_dual += float((dual * mask).sum())
        m_kl += float((kl.detach() * mask).sum())
    metrics = {
        "num_tokens": m_n,
        "policy_tokens": m_kept,
        "tis_sum": m_tis,
        "dual_clip_count": m_dual,
        "kl_penalty_sum": m_kl,
        "entropy_sum": m_ent,
        "kl_inference_sum": m_kli,
    }
    return total / normalizer, metrics
