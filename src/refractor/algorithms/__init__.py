"""RL algorithms as pure functions: advantages, output filters, packing, log-probs, the loss.

Orchestrator (per group, then per batch):
    settings = AdvantageSettings.from_config(cfg)
    scores = score_group(rewards, num_completion_tokens, settings, reward_min=..., reward_max=...)
        -> shaped rewards, stage-1 advantages, ``zero_advantage`` (discard the group)
    advantages = normalize_batch_advantages(batch_advantages, settings)      # stage 2
    flags = output_filter_flags(token_ids, logprobs, text, is_truncated, FilterSettings.from_config(cfg))
        -> zero a flagged rollout's loss mask with ``without_loss(sample)``; ``filter_metrics(flags)``
Trainer (per step, per micro-batch):
    batch = pack_train_batch(samples, step=, seq_len=, pad_to_multiple_of=, pad_token_id=,
                             num_dp_ranks=, number_of_minibatches=, aggregation=settings.aggregation,
                             max_tokens=cfg.max_tokens)                       # TrainBatch
    logprobs, entropy = token_logprobs_and_entropy(hidden, lm_head.weight, mb.input_ids,
                                                   temperature=cfg.temperature,
                                                   chunk_size=cfg.entropy_chunk_size)
    out = policy_loss(logprobs, mb.rollout_logprobs, mb.advantages, mb.loss_mask, mb.document_ids,
                      LossSettings.from_config(cfg), mb.loss_normalizer, entropy=entropy)
    out.loss.backward()       # no division by the micro-batch count; SUM gradients over DP ranks
    stats = stats + out.stats # then all-reduce stats.values and call loss_metrics(stats, settings)
Attention over packed rows (samples kept apart by ``mb.document_ids``) is the model's
``refractor.models.attention.PackedAttention``.
"""

from refractor.algorithms.advantages import (
    AdvantageSettings,
    GroupScores,
    group_advantages,
    is_zero_advantage_group,
    normalize_batch_advantages,
    normalize_reward,
    overlong_penalty,
    score_group,
)
from refractor.algorithms.filters import (
    FilterFlags,
    FilterSettings,
    filter_metrics,
    is_gibberish,
    is_repetitive,
    output_filter_flags,
    sample_filter_flags,
    without_loss,
)
from refractor.algorithms.logprobs import (
    chunked_logprobs_entropy,
    effective_temperature,
    token_logprobs_and_entropy,
)
from refractor.algorithms.loss import (
    LossOutput,
    LossSettings,
    LossStats,
    loss_metrics,
    loss_normalizer,
    policy_loss,
)
from refractor.algorithms.packing import pack_train_batch

__all__ = [
    "AdvantageSettings",
    "GroupScores",
    "group_advantages",
    "is_zero_advantage_group",
    "normalize_batch_advantages",
    "normalize_reward",
    "overlong_penalty",
    "score_group",
    "FilterFlags",
    "FilterSettings",
    "filter_metrics",
    "is_gibberish",
    "is_repetitive",
    "output_filter_flags",
    "sample_filter_flags",
    "without_loss",
    "chunked_logprobs_entropy",
    "effective_temperature",
    "token_logprobs_and_entropy",
    "LossOutput",
    "LossSettings",
    "LossStats",
    "loss_metrics",
    "loss_normalizer",
    "policy_loss",
    "pack_train_batch",
]
