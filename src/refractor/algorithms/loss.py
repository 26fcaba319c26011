"""The RL policy loss of one packed micro-batch, normalized by a global per-step constant.

Formulas in docs/algorithms.md#policy-loss (order: seq-IS mask, per-algorithm token loss, PPO clip, dual clip,
TIS, KL penalty, entropy bonus, mask, aggregation), with these deliberate differences from Telescope
(docs/config.md#deliberate-differences):

* Aggregation is explicit and global: ``loss = sum_t P_t * m_t / normalizer`` where the normalizer
  (see ``loss_normalizer``) is computed once per (mini)batch over all micro-batches and DP ranks.
  Summing the per-micro-batch losses therefore gives the same value (and gradient) however the
  samples were packed. Consequences for the caller: do NOT divide by the number of micro-batches,
  and SUM gradients over DP ranks (FSDP2 averages by default: scale the loss by the DP world size
  or call ``set_gradient_divide_factor(1.0)``).
* DR-GRPO ``token_sum_norm`` divides by ``num_samples * max_tokens`` (a constant budget), not by the
  packed row length.
* Dual clip for CISPO bounds the importance weight (``sg(min(clip(rho), c))`` for A < 0) instead of
  comparing a log-prob-valued loss with ``c * |A|``.
* The entropy bonus is a per-token term ``-entropy_coef * H_t`` aggregated like the policy term (a
  global token mean by default).
* GSPO (as in Telescope): the token gradient is that of ``sum_s f(S_s) / normalizer`` (each of a
  sequence's n_s tokens carries 1/n_s of it), while the forward value repeats ``f(S_s)`` per token.
* Seq-IS rejected tokens stay in the normalizer (they contribute 0, like clipped tokens in PPO); the
  normalizer has to be known before the forward pass to be global.

Metrics are returned as token sums in a ``LossStats`` tensor: add them over micro-batches, all-reduce
over ranks, then call ``loss_metrics``. Diagnostics (``entropy``, ``kl_divergence_inference``) use
the original loss mask; policy-side metrics use the mask after seq-IS masking.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

LOG_RATIO_CLAMP = 20.0  # clamp on log-ratios before exp (rho and seq-IS): exp stays finite in fp32
GSPO_LOG_RATIO_MAX = 10.0
K3_MAX = 10.0

Aggregation = Literal["token_mean", "token_sum_norm"]


@dataclass(frozen=True)
class LossSettings:
    """The config fields the loss reads. Cross-field validity is enforced by the config schema."""

    algorithm: str = "grpo"
    use_ppo_clip: bool = False
    clip_low: float = 0.4
    clip_high: float = 0.5
    clip_ratio_c: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    dr_grpo_loss_agg_mode: str = "token_mean"
    use_tis: bool = False
    tis_cap: float = 2.0
    tis_logprob_clamp: float = 20.0
    tis_mode: str = "truncate"
    tis_floor: float = 0.0
    kl_penalty_tau: float = 0.0
    kl_estimator: str = "k2"
    entropy_coef: float = 0.0
    seq_is_masking: bool = False
    seq_is_mask_low: float = 0.8
    seq_is_mask_high: float = 1.2
    max_tokens: int = 3700

    @classmethod
    def from_config(cls, cfg: Any) -> LossSettings:
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    @property
    def aggregation(self) -> Aggregation:
        if self.algorithm == "dr_grpo" and self.dr_grpo_loss_agg_mode == "token_sum_norm":
            return "token_sum_norm"
        return "token_mean"

    @property
    def needs_entropy_grad(self) -> bool:
        return self.entropy_coef > 0


def loss_normalizer(
    num_trainable_tokens: int, num_samples: int, aggregation: Aggregation, max_tokens: int
) -> float:
    """The global divisor of one optimizer step's loss (all micro-batches, all DP ranks).

    token_mean: trainable tokens; token_sum_norm (DR-GRPO): samples x max_tokens. Never below 1.
    """
    if aggregation == "token_sum_norm":
        return float(max(num_samples * max_tokens, 1))
    return float(max(num_trainable_tokens, 1))


# ---- metrics --------------------------------------------------------------------------------
STAT_NAMES = (
    "loss",
    "num_tokens",
    "entropy_sum",
    "kl_inference_sum",
    "policy_tokens",
    "tis_sum",
    "tis_zero_count",
    "dual_clip_count",
    "kl_penalty_sum",
)


@dataclass
class LossStats:
    """Additive statistics of one or more micro-batches as one detached 1-D tensor (``STAT_NAMES``).

    Keep it on the device, add it over micro-batches, all-reduce(SUM) ``values`` over DP ranks.
    """

    values: torch.Tensor

    @classmethod
    def zeros(cls, device: torch.device | str = "cpu") -> LossStats:
        return cls(torch.zeros(len(STAT_NAMES), dtype=torch.float64, device=device))

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(self.values + other.values)

    def as_dict(self) -> dict[str, float]:
        return dict(zip(STAT_NAMES, self.values.tolist(), strict=True))


def loss_metrics(stats: LossStats, settings: LossSettings) -> dict[str, float]:
    """Step metrics (docs/metrics.md#loss-metrics) from summed ``LossStats``."""
    s = stats.as_dict()
    n = max(s["num_tokens"], 1.0)
    kept = max(s["policy_tokens"], 1.0)
    out = {
        "loss": s["loss"],
        "entropy": s["entropy_sum"] / n,
        "kl_divergence_inference": s["kl_inference_sum"] / n,
        "num_tokens": s["num_tokens"],
    }
    if settings.seq_is_masking:
        out["seq_is_masked_frac"] = 1.0 - s["policy_tokens"] / n
    if settings.use_tis:
        out["tis_mean"] = s["tis_sum"] / kept
        if settings.tis_mode == "icepop":
            out["tis_zero_frac"] = s["tis_zero_count"] / kept
    if settings.clip_ratio_c is not None:
        out["dual_clip_frac"] = s["dual_clip_count"] / kept
    if settings.kl_penalty_tau > 0:
        out["kl_penalty"] = s["kl_penalty_sum"] / kept
    if settings.entropy_coef > 0:
        out["entropy_bonus"] = settings.entropy_coef * out["entropy"]
    return out


# ---- per-segment helpers (a segment = one packed sample; padding = its own segment) ----------
def _segment_index(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    idx = document_ids.long() + 1  # padding (-1) -> 0
    return idx, int(idx.max().item()) + 1 if idx.numel() else 1


def _segment_sum(x: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, idx, x)


def _segment_masked_mean(x: torch.Tensor, mask: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """Per-token value of the masked mean of ``x`` over the token's segment (count floored at 1)."""
    total = _segment_sum(x * mask, idx, n)
    count = _segment_sum(mask, idx, n).clamp(min=1)
    return (total / count)[idx]


# ---- the loss --------------------------------------------------------------------------------
@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar with grad: this micro-batch's share of the step loss
    stats: LossStats


def policy_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    settings: LossSettings,
    normalizer: float,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> LossOutput:
    """Loss of one micro-batch. All tensors are 1-D [T], aligned with ``input_ids`` (records.py).

    logprobs: trainer log-probs (with grad); rollout_logprobs: the inference engine's;
    ref_logprobs: ratio reference (``ppo_clip_ref_logprobs: batch``), defaults to rollout_logprobs;
    entropy: per-token entropy (needs grad when ``entropy_coef > 0``; used for the metric);
    document_ids: sample index within the row, -1 on padding; normalizer: ``loss_normalizer``.
    """
    s = settings
    mask0 = loss_mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)
    rollout = rollout_logprobs.to(logprobs.dtype)
    ref = rollout if ref_logprobs is None else ref_logprobs.to(logprobs.dtype)
    if s.seq_is_masking or s.algorithm == "gspo":  # .item() syncs: only when segments matter
        idx, nseg = _segment_index(document_ids)
    log_ratio_rollout = logprobs - rollout  # Delta: distance to the rollout policy
    log_ratio = logprobs - ref  # delta: ratio reference
    delta_rollout = log_ratio_rollout.detach()

    # 1. sequence-level IS masking
    mask = mask0
    if s.seq_is_masking:
        seq_log_ratio = _segment_masked_mean(delta_rollout, mask0, idx, nseg)
        seq_weight = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        mask = mask0 * ((seq_weight >= s.seq_is_mask_low) & (seq_weight <= s.seq_is_mask_high)).to(
            mask0.dtype
        )

    lo = 1.0 - s.clip_low
    hi = 1.0 + s.clip_high
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    dual_clipped = torch.zeros_like(mask)

    # 2./3. per-token policy loss
    if s.algorithm == "cispo":
        weight = ratio.detach().clamp(lo, hi)
        if s.clip_ratio_c is not None:  # dual clip on the weight, for A < 0 (fixed unit mix)
            capped = (adv < 0) & (weight > s.clip_ratio_c)
            weight = torch.where(capped, torch.full_like(weight, s.clip_ratio_c), weight)
            dual_clipped = capped.to(mask.dtype)
        per_token = -weight * logprobs * adv
    elif s.algorithm == "gspo":
        n_s = _segment_sum(mask, idx, nseg).clamp(min=1)[idx]
        seq_value = _segment_masked_mean(log_ratio.detach(), mask, idx, nseg)
        token_share = log_ratio / n_s
        lam = token_share - token_share.detach() + seq_value  # value S_s, gradient 1/n_s per token
        seq_ratio = torch.exp(lam.clamp(max=GSPO_LOG_RATIO_MAX))
        seq_adv = _segment_masked_mean(adv, mask, idx, nseg)
        per_token = torch.maximum(-seq_ratio * seq_adv, -seq_ratio.clamp(lo, hi) * seq_adv)
    elif s.algorithm == "sapo":
        tau = torch.where(adv > 0, torch.full_like(adv, s.sapo_tau_pos), torch.full_like(adv, s.sapo_tau_neg))
        per_token = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
    elif s.use_ppo_clip:
        per_token = torch.maximum(-ratio * adv, -ratio.clamp(lo, hi) * adv)
    else:  # grpo, rloo, reinforce_pp, dr_grpo
        per_token = -logprobs * adv

    # 4. dual clip (value form: PPO surrogate and GSPO, where P is ratio x advantage)
    if s.clip_ratio_c is not None and s.algorithm != "cispo":
        bound = s.clip_ratio_c * adv.abs()
        dual_clipped = (bound < per_token).to(mask.dtype)
        per_token = torch.minimum(per_token, bound)

    # 5. truncated importance sampling w.r.t. the rollout policy (weights are constants)
    tis = torch.ones_like(mask)
    if s.use_tis:
        raw = torch.exp(delta_rollout.clamp(-s.tis_logprob_clamp, s.tis_logprob_clamp))
        if s.tis_mode == "icepop":
            tis = torch.where((raw >= s.tis_floor) & (raw <= s.tis_cap), raw, torch.zeros_like(raw))
        else:
            tis = raw.clamp(max=s.tis_cap)
        per_token = per_token * tis

    # 6. KL penalty to the rollout policy (gradient through logprobs)
    kl = torch.zeros_like(mask)
    if s.kl_penalty_tau > 0:
        if s.kl_estimator == "k3":
            d = log_ratio_rollout.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            kl = (torch.exp(-d) - 1.0 + d).clamp(max=K3_MAX)
        else:
            kl = log_ratio_rollout.square()
        per_token = per_token + s.kl_penalty_tau * kl

    # entropy bonus, as a per-token term aggregated like the policy term
    if s.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token `entropy` (with grad)")
        per_token = per_token - s.entropy_coef * entropy.to(per_token.dtype)

    # 7./8. mask and global aggregation
    loss = (per_token * mask).sum() / normalizer

    with torch.no_grad():
        ent = entropy.detach().to(mask0.dtype) if entropy is not None else torch.zeros_like(mask0)
        d = delta_rollout.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # one wild token cannot make it inf
        kl_inference = torch.exp(d) - 1.0 - d
        stat_values = torch.stack(
            [
                loss.detach(),
                mask0.sum(),
                (ent * mask0).sum(),
                (kl_inference * mask0).sum(),
                mask.sum(),
                (tis * mask).sum(),
                ((tis == 0).to(mask.dtype) * mask).sum(),
                (dual_clipped * mask).sum(),
                (kl.detach() * mask).sum(),
            ]
        ).to(torch.float64)
    return LossOutput(loss=loss, stats=LossStats(stat_values))
