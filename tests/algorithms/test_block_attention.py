"""Block-diagonal causal attention: the SDPA oracle, the FlexAttention variant, sample isolation."""

from __future__ import annotations

import math

import pytest
import torch

from refractor.algorithms import (
    block_causal_attention,
    block_causal_mask,
    document_block_mask,
    flex_block_causal_attention,
    pack_train_batch,
)
from refractor.records import TrainSample


def _row(lengths, seq_len=64, pad_to=16):
    samples = [
        TrainSample(
            input_ids=[1] * n,
            loss_mask=[0] + [1] * (n - 1),
            advantage=0.0,
            rollout_logprobs=[0.0] * n,
            sample_id=i,
        )
        for i, n in enumerate(lengths)
    ]
    batch = pack_train_batch(samples, step=0, seq_len=seq_len, pad_to_multiple_of=pad_to, pad_token_id=0)
    (mb,) = batch.micro_batches[0]
    return mb


def naive_attention(q, k, v, doc):
    """Per-document loop in float64: each sample attends causally to itself only."""
    h, t, d = q.shape
    k = k.repeat_interleave(h // k.shape[0], dim=0)
    v = v.repeat_interleave(h // v.shape[0], dim=0)
    out = torch.zeros_like(q)
    for i in range(t):
        keys = [j for j in range(i + 1) if doc[j] == doc[i] and doc[i] >= 0] or [i]
        s = (q[:, i : i + 1] @ k[:, keys].transpose(1, 2)) / math.sqrt(d)
        out[:, i] = (torch.softmax(s, -1) @ v[:, keys])[:, 0]
    return out


def qkv(t, heads=4, kv_heads=2, dim=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(heads, t, dim, generator=g, dtype=dtype),
        torch.randn(kv_heads, t, dim, generator=g, dtype=dtype),
        torch.randn(kv_heads, t, dim, generator=g, dtype=dtype),
    )


def test_mask_rule():
    doc = torch.tensor([0, 0, 1, 1, 1, -1, -1])
    m = block_causal_mask(doc)
    assert m[1, 0] and not m[0, 1]  # causal inside a sample
    assert not m[2, 1] and m[4, 2]  # no attention to an earlier sample
    assert m[5, 5] and not m[6, 5]  # padding attends only to itself
    assert m.any(dim=1).all()  # no fully masked row (no NaN)


def test_oracle_matches_per_document_loop():
    mb = _row([7, 12, 3, 20])
    q, k, v = qkv(mb.num_tokens, dtype=torch.float64)
    torch.testing.assert_close(
        block_causal_attention(q, k, v, mb.document_ids), naive_attention(q, k, v, mb.document_ids.tolist())
    )


def test_flex_matches_oracle_on_cpu():
    mb = _row([30, 50, 10, 37], seq_len=160, pad_to=64)  # 192 tokens: crosses 128-token blocks
    q, k, v = qkv(mb.num_tokens)
    ref = block_causal_attention(q, k, v, mb.document_ids)
    out = flex_block_causal_attention(q, k, v, document_block_mask(mb.document_ids))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_perturbing_one_sample_leaves_the_others_unchanged(backend):
    mb = _row([9, 14, 6, 11])
    doc = mb.document_ids
    q, k, v = qkv(mb.num_tokens)

    def attend(q, k, v):
        if backend == "sdpa":
            return block_causal_attention(q, k, v, doc)
        return flex_block_causal_attention(q, k, v, document_block_mask(doc))

    base = attend(q, k, v)
    victim = doc == 1
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, victim] += 5.0
    k2[:, victim] = torch.randn_like(k2[:, victim])
    v2[:, victim] *= -3.0
    out = attend(q2, k2, v2)
    assert torch.equal(out[:, ~victim], base[:, ~victim])
    assert not torch.allclose(out[:, victim], base[:, victim])


@pytest.mark.gpu
def test_flex_matches_oracle_on_cuda():
    mb = _row([300, 500, 120, 80], seq_len=1024, pad_to=128)
    doc = mb.document_ids.cuda()
    q, k, v = (x.cuda().bfloat16() for x in qkv(mb.num_tokens, heads=14, kv_heads=2, dim=64))
    ref = block_causal_attention(q.float(), k.float(), v.float(), doc)
    out = flex_block_causal_attention(q, k, v, document_block_mask(doc))
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
