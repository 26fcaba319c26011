"""Packing properties (hypothesis) and invariance of the step loss to how samples were packed."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refractor.algorithms import LossSettings, pack_train_batch, policy_loss
from refractor.algorithms.packing import PackingSettings, first_fit_decreasing, pack_step, split_minibatches
from refractor.records import TrainSample

PAD_ID = 7


def make_sample(i: int, n: int, rng: random.Random) -> TrainSample:
    prompt = min(n, rng.randint(1, 4))
    mask = [0] * prompt + [rng.choice([1, 1, 1, 0]) for _ in range(n - prompt)]
    ids = [1000 * (i + 1) + t for t in range(n)]  # every token unique: loss/duplication is visible
    lps = [-(t % 5) * 0.1 - 0.01 if m else 0.0 for t, m in enumerate(mask)]
    return TrainSample(
        input_ids=ids, loss_mask=mask, advantage=rng.uniform(-2, 2), rollout_logprobs=lps, sample_id=i
    )


def samples_from(lengths, seed=0):
    rng = random.Random(seed)
    return [make_sample(i, n, rng) for i, n in enumerate(lengths)]


lengths_st = st.lists(st.integers(min_value=1, max_value=90), min_size=1, max_size=24)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=lengths_st,
    seq_len=st.integers(16, 80),
    pad_to=st.sampled_from([1, 4, 16]),
    ranks=st.integers(1, 4),
    minibatches=st.integers(1, 3),
)
def test_packing_properties(lengths, seq_len, pad_to, ranks, minibatches):
    pad_to = min(pad_to, seq_len)
    samples = samples_from(lengths)
    batch = pack_train_batch(
        samples,
        step=3,
        seq_len=seq_len,
        pad_to_multiple_of=pad_to,
        pad_token_id=PAD_ID,
        num_dp_ranks=ranks,
        number_of_minibatches=minibatches,
    )
    assert len(batch.micro_batches) == ranks and batch.step == 3 and batch.num_samples == len(samples)
    seen: dict[int, list[int]] = {}
    for rank_rows in batch.micro_batches:
        for mb in rank_rows:
            t = mb.num_tokens
            assert t % pad_to == 0
            for name in ("position_ids", "document_ids", "loss_mask", "advantages", "rollout_logprobs"):
                assert getattr(mb, name).shape == (t,)
            cu = mb.cu_seqlens.tolist()
            assert cu[0] == 0 and cu[-1] == t and mb.cu_seqlens.dtype == torch.int32
            assert mb.max_seqlen == max(b - a for a, b in zip(cu, cu[1:], strict=False))
            real = int((mb.document_ids >= 0).sum())
            assert real <= seq_len  # bins never exceed seq_len
            assert t - real < pad_to or (real == 0 and t == pad_to)  # minimal padding
            for d, (a, b) in enumerate(zip(cu, cu[1:], strict=False)):
                # positions restart at every boundary and count up inside a segment
                assert mb.position_ids[a:b].tolist() == list(range(b - a))
                if d < len(mb.sample_ids):
                    assert (mb.document_ids[a:b] == d).all()
                    sid = mb.sample_ids[d]
                    assert sid not in seen, "sample packed twice"
                    seen[sid] = mb.input_ids[a:b].tolist()
                    s = samples[sid]
                    assert mb.loss_mask[a] == 0  # first token of a sample is never trainable
                    assert mb.loss_mask[a + 1 : b].tolist() == s.loss_mask[1 : b - a]
                    assert (mb.advantages[a:b] == torch.tensor(s.advantage, dtype=torch.float32)).all()
                    assert mb.rollout_logprobs[a:b].tolist() == pytest.approx(s.rollout_logprobs[: b - a])
                else:  # the padding tail
                    assert (mb.document_ids[a:b] == -1).all() and (mb.loss_mask[a:b] == 0).all()
                    assert (mb.input_ids[a:b] == PAD_ID).all()
    # no token lost or duplicated (up to the counted truncation)
    assert sorted(seen) == list(range(len(samples)))
    for sid, ids in seen.items():
        assert ids == samples[sid].input_ids[:seq_len]
    truncated = [n for n in lengths if n > seq_len]
    assert batch.metrics["packing/truncated_samples"] == len(truncated)
    assert batch.metrics["packing/truncated_tokens"] == sum(n - seq_len for n in truncated)
    # every rank does the same number of passes per minibatch; ranks balanced within one sample
    for mbi in range(len(split_minibatches(len(samples), minibatches))):
        counts = [sum(mb.minibatch == mbi for mb in rows) for rows in batch.micro_batches]
        assert len(set(counts)) == 1 and counts[0] >= 1
        tokens = [
            sum(int((mb.document_ids >= 0).sum()) for mb in rows if mb.minibatch == mbi)
            for rows in batch.micro_batches
        ]
        longest = max(min(n, seq_len) for n in lengths)
        assert max(tokens) - min(tokens) <= longest
        norms = {mb.loss_normalizer for rows in batch.micro_batches for mb in rows if mb.minibatch == mbi}
        trainable = sum(
            float(mb.loss_mask.sum()) for rows in batch.micro_batches for mb in rows if mb.minibatch == mbi
        )
        assert norms == {max(trainable, 1.0)}
    noop = [mb for rows in batch.micro_batches for mb in rows if mb.is_noop]
    assert batch.metrics["packing/noop_micro_batches"] == len(noop)
    assert all(mb.num_tokens == pad_to and mb.loss_mask.sum() == 0 for mb in noop)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=30), capacity=st.integers(50, 120))
def test_first_fit_decreasing_is_a_valid_packing(lengths, capacity):
    bins = first_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    # FFD never leaves two bins that could be merged
    loads = sorted(sum(lengths[i] for i in b) for b in bins)
    assert len(loads) < 2 or loads[0] + loads[1] > capacity


def row_logprobs(mb, per_sample_lp):
    """A packed row's trainer log-probs, gathered from fixed per-sample leaf tensors."""
    parts = [
        per_sample_lp[sid][: int(b - a)]
        for sid, a, b in zip(mb.sample_ids, mb.cu_seqlens.tolist(), mb.cu_seqlens.tolist()[1:], strict=False)
    ]
    pad = mb.num_tokens - sum(p.shape[0] for p in parts)
    return torch.cat(parts + [torch.full((pad,), -1.0, dtype=torch.float64)])


def step_loss_and_grads(samples, per_sample_lp_values, settings_, **pack_kw):
    batch = pack_train_batch(
        samples, step=0, pad_token_id=PAD_ID, aggregation=settings_.aggregation, max_tokens=64, **pack_kw
    )
    leaves = {s.sample_id: per_sample_lp_values[s.sample_id].clone().requires_grad_() for s in samples}
    total = torch.zeros((), dtype=torch.float64)
    for rows in batch.micro_batches:
        for mb in rows:
            lp = row_logprobs(mb, leaves)
            out = policy_loss(
                lp,
                mb.rollout_logprobs.double(),
                mb.advantages.double(),
                mb.loss_mask.double(),
                mb.document_ids,
                settings_,
                mb.loss_normalizer,
            )
            if out.loss.requires_grad:  # a no-op row has no trainable leaf here (a model always has)
                out.loss.backward()
            total = total + out.loss.detach()
    return total, {
        sid: leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for sid, leaf in leaves.items()
    }


LOSS_CASES = [
    LossSettings(),
    LossSettings(algorithm="gspo", clip_ratio_c=2.0),
    LossSettings(
        use_ppo_clip=True,
        use_tis=True,
        kl_penalty_tau=0.1,
        kl_estimator="k3",
        seq_is_masking=True,
        seq_is_mask_low=0.5,
        seq_is_mask_high=1.6,
    ),
    LossSettings(algorithm="dr_grpo", dr_grpo_loss_agg_mode="token_sum_norm"),
]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(2, 40), min_size=1, max_size=10),
    seed=st.integers(0, 1000),
    case=st.sampled_from(range(len(LOSS_CASES))),
)
def test_step_loss_is_invariant_to_packing(lengths, seed, case):
    """Same samples, different order / seq_len / DP ranks: same summed loss and same gradients."""
    settings_ = LOSS_CASES[case]
    samples = samples_from(lengths, seed)
    g = torch.Generator().manual_seed(seed)
    lp_values = {
        s.sample_id: torch.tensor(s.rollout_logprobs, dtype=torch.float64)
        + 0.3 * torch.randn(len(s.input_ids), generator=g, dtype=torch.float64)
        for s in samples
    }
    shuffled = list(samples)
    random.Random(seed).shuffle(shuffled)
    loss_a, grads_a = step_loss_and_grads(samples, lp_values, settings_, seq_len=40, pad_to_multiple_of=8)
    loss_b, grads_b = step_loss_and_grads(
        shuffled, lp_values, settings_, seq_len=100, pad_to_multiple_of=4, num_dp_ranks=3
    )
    loss_c, grads_c = step_loss_and_grads(
        samples, lp_values, settings_, seq_len=45, pad_to_multiple_of=1, num_dp_ranks=2
    )
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss_a, loss_c, rtol=1e-12, atol=1e-12)
    for sid in grads_a:
        torch.testing.assert_close(grads_a[sid], grads_b[sid], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grads_a[sid], grads_c[sid], rtol=1e-12, atol=1e-12)


def test_minibatches_split_contiguously_with_their_own_normalizer():
    samples = samples_from([10, 20, 30, 40, 50], seed=1)
    batch = pack_train_batch(
        samples, step=0, seq_len=64, pad_to_multiple_of=8, pad_token_id=PAD_ID, number_of_minibatches=2
    )
    by_mb: dict[int, set[int]] = {}
    for mb in batch.micro_batches[0]:
        by_mb.setdefault(mb.minibatch, set()).update(mb.sample_ids)
        tokens = sum(
            s.num_trainable_tokens - s.loss_mask[0]
            for s in samples
            if s.sample_id in ({0, 1, 2} if mb.minibatch == 0 else {3, 4})
        )
        assert mb.loss_normalizer == tokens
    assert by_mb == {0: {0, 1, 2}, 1: {3, 4}}
    assert batch.loss_normalizer == sum(s.num_trainable_tokens - s.loss_mask[0] for s in samples)


def test_dr_grpo_normalizer_is_samples_times_max_tokens():
    samples = samples_from([10, 20, 30])
    batch = pack_train_batch(
        samples,
        step=0,
        seq_len=64,
        pad_to_multiple_of=8,
        pad_token_id=PAD_ID,
        aggregation="token_sum_norm",
        max_tokens=100,
        num_dp_ranks=2,
    )
    assert {mb.loss_normalizer for rows in batch.micro_batches for mb in rows} == {300.0}


def test_more_ranks_than_samples_gives_noop_rows():
    batch = pack_train_batch(
        samples_from([12]), step=0, seq_len=64, pad_to_multiple_of=16, pad_token_id=PAD_ID, num_dp_ranks=3
    )
    assert [len(r) for r in batch.micro_batches] == [1, 1, 1]
    assert sum(mb.is_noop for rows in batch.micro_batches for mb in rows) == 2
    noop = batch.micro_batches[1][0]
    assert noop.num_tokens == 16 and noop.cu_seqlens.tolist() == [0, 16] and (noop.document_ids == -1).all()


def test_errors_name_the_culprit():
    with pytest.raises(ValueError, match="at least one sample"):
        pack_train_batch([], step=0, seq_len=8, pad_to_multiple_of=1, pad_token_id=0)
    with pytest.raises(ValueError, match="sample 5 has no tokens"):
        pack_train_batch(
            [TrainSample([], [], 0.0, [], sample_id=5)],
            step=0,
            seq_len=8,
            pad_to_multiple_of=1,
            pad_token_id=0,
        )
    with pytest.raises(ValueError, match="num_dp_ranks"):
        pack_train_batch(
            samples_from([3]), step=0, seq_len=8, pad_to_multiple_of=1, pad_token_id=0, num_dp_ranks=0
        )


def assert_same_batch(a, b) -> None:
    assert (a.step, a.loss_normalizer, a.num_samples, a.metrics) == (
        b.step,
        b.loss_normalizer,
        b.num_samples,
        b.metrics,
    )
    assert [len(rows) for rows in a.micro_batches] == [len(rows) for rows in b.micro_batches]
    for rows_a, rows_b in zip(a.micro_batches, b.micro_batches, strict=True):
        for x, y in zip(rows_a, rows_b, strict=True):
            assert (x.sample_ids, x.minibatch, x.loss_normalizer) == (
                y.sample_ids,
                y.minibatch,
                y.loss_normalizer,
            )
            assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)


def test_settings_from_a_config_pack_as_the_explicit_call():
    from refractor.config import load_config

    cfg = load_config(
        None,
        {
            "environments": [{"name": "countdown"}],
            "algorithm": "dr_grpo",
            "dr_grpo_loss_agg_mode": "token_sum_norm",
            "max_tokens": 100,
            "max_model_len": 200,
            "seq_len": 64,
            "pad_to_multiple_of": 8,
            "number_of_minibatches": 2,
        },
    )
    settings = PackingSettings.from_config(cfg, pad_token_id=PAD_ID)
    assert settings == PackingSettings(
        seq_len=64,
        pad_to_multiple_of=8,
        pad_token_id=PAD_ID,
        number_of_minibatches=2,
        aggregation="token_sum_norm",
        max_tokens=100,
    )
    samples = samples_from([10, 70, 30, 25, 5], seed=3)
    expected = pack_train_batch(
        samples,
        step=4,
        seq_len=64,
        pad_to_multiple_of=8,
        pad_token_id=PAD_ID,
        num_dp_ranks=2,
        number_of_minibatches=2,
        aggregation="token_sum_norm",
        max_tokens=100,
    )
    assert_same_batch(pack_step(samples, 4, settings, num_dp_ranks=2), expected)
    assert expected.loss_normalizer == 500.0 and expected.metrics["packing/truncated_samples"] == 1.0
