"""PackedAttention keeps packed samples apart on every path the trainer runs.

Each path is checked against an independent float64 per-document loop: SDPA with the explicit
block-causal mask (CPU), FlexAttention with the document mask (compiled, on CPU here and on CUDA),
and FlexAttention traced inside a compiled decoder layer.
"""

from __future__ import annotations

import math

import pytest
import torch

from refractor.algorithms import pack_train_batch
from refractor.models.attention import PackedAttention, block_causal_mask
from refractor.records import TrainSample

HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16


def _micro_batch(lengths, seq_len, pad_to):
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


def _document_ids(lengths, seq_len, pad_to):
    return _micro_batch(lengths, seq_len, pad_to).document_ids


def _row_documents():
    """192 tokens (crosses FlexAttention's 128-token blocks): four samples, then padding."""
    docs = _document_ids([40, 50, 10, 47], seq_len=160, pad_to=64)
    assert docs.shape[0] == 192 and (docs < 0).any()
    return docs


def per_document_attention(q, k, v, document_ids):
    """[T, H, D] in float64, one query at a time over the keys of its own sample only."""
    q = q.double()
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.double().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    docs = document_ids.tolist()
    out = torch.zeros_like(q)
    for i in range(q.shape[0]):
        keys = [j for j in range(i + 1) if docs[j] == docs[i] and docs[i] >= 0] or [i]
        scores = torch.einsum("hd,khd->hk", q[i], k[keys]) / math.sqrt(q.shape[-1])
        out[i] = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), v[keys])
    return out


def qkv(t, seed=0, dtype=torch.float32, heads=HEADS, kv_heads=KV_HEADS, dim=HEAD_DIM):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(t, heads, dim, generator=g, dtype=dtype),
        torch.randn(t, kv_heads, dim, generator=g, dtype=dtype),
        torch.randn(t, kv_heads, dim, generator=g, dtype=dtype),
    )


def test_block_causal_mask_is_causal_inside_a_sample_and_padding_sees_only_itself():
    doc = torch.tensor([0, 0, 1, 1, 1, -1, -1])
    m = block_causal_mask(doc)
    assert m[1, 0] and not m[0, 1]  # causal inside a sample
    assert not m[2, 1] and m[4, 2]  # no attention to an earlier sample
    assert m[5, 5] and not m[6, 5]  # padding attends only to itself
    assert m.any(dim=1).all()  # no fully masked row (no NaN)


def test_sdpa_path_equals_the_per_document_loop_in_float64():
    docs = _row_documents()
    q, k, v = qkv(docs.shape[0], dtype=torch.float64)
    out = PackedAttention(docs, backend="sdpa")(q, k, v, layer_index=0)
    torch.testing.assert_close(out, per_document_attention(q, k, v, docs))


def test_auto_backend_on_cpu_is_the_sdpa_path_without_a_block_mask():
    docs = _row_documents()
    q, k, v = qkv(docs.shape[0])
    attention = PackedAttention(docs)
    out = attention(q, k, v, layer_index=0)
    assert attention._block_mask is None
    torch.testing.assert_close(out, PackedAttention(docs, backend="sdpa")(q, k, v, layer_index=0))


def test_flex_path_on_cpu_matches_the_per_document_loop():
    docs = _row_documents()
    q, k, v = qkv(docs.shape[0])
    out = PackedAttention(docs, backend="flex")(q, k, v, layer_index=0)
    torch.testing.assert_close(out.double(), per_document_attention(q, k, v, docs), rtol=1e-5, atol=1e-5)


def test_flex_traced_inside_a_compiled_layer_matches_the_per_document_loop():
    docs = _row_documents()
    q, k, v = qkv(docs.shape[0])
    attention = PackedAttention(docs, backend="flex")
    attention(q, k, v, layer_index=0)  # builds the block mask the compiled layer reuses
    layer = torch.compile(
        lambda q, k, v: attention(q, k, v, layer_index=0), backend="aot_eager", fullgraph=True
    )
    out = layer(q, k, v)
    torch.testing.assert_close(out.double(), per_document_attention(q, k, v, docs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_perturbing_one_sample_leaves_the_others_unchanged(backend):
    docs = _row_documents()
    q, k, v = qkv(docs.shape[0])
    attention = PackedAttention(docs, backend=backend)
    base = attention(q, k, v, layer_index=0)
    victim = docs == 1
    q2 = q.clone()
    k2 = k.clone()
    v2 = v.clone()
    q2[victim] += 5.0
    k2[victim] = torch.randn_like(k2[victim])
    v2[victim] *= -3.0
    out = attention(q2, k2, v2, layer_index=0)
    assert torch.equal(out[~victim], base[~victim])
    assert not torch.allclose(out[victim], base[victim])


@pytest.mark.gpu
def test_default_flex_path_on_cuda_matches_the_per_document_loop():
    docs = _document_ids([300, 500, 120, 80], seq_len=1024, pad_to=128).cuda()
    q, k, v = (x.cuda().bfloat16() for x in qkv(docs.shape[0], heads=14, kv_heads=2, dim=64))
    attention = PackedAttention(docs)
    assert attention._block_mask is not None  # CUDA builds the FlexAttention mask up front
    out = attention(q, k, v, layer_index=0)
    ref = per_document_attention(q.cpu(), k.cpu(), v.cpu(), docs.cpu())
    torch.testing.assert_close(out.double().cpu(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_default_varlen_path_on_cuda_matches_the_per_document_loop_with_gradients():
    """The trainer's default on CUDA (bf16, ``cu_seqlens`` given): no block mask is built (nothing
    to compile); outputs and gradients of the real tokens match the float64 loop."""
    mb = _micro_batch([300, 500, 120, 80], seq_len=1024, pad_to=128)
    docs = mb.document_ids.cuda()
    attention = PackedAttention(docs, cu_seqlens=mb.cu_seqlens.cuda(), max_seqlen=mb.max_seqlen)
    assert attention._block_mask is None and attention._varlen_ready()
    q, k, v = (x.cuda().bfloat16().requires_grad_() for x in qkv(docs.shape[0], heads=14, kv_heads=2, dim=64))
    real = (docs >= 0).cpu()
    weights = torch.randn(docs.shape[0], 14, 64, generator=torch.Generator().manual_seed(1))[real]
    out = attention(q, k, v, layer_index=0)
    (out.float().cpu()[real] * weights).sum().backward()
    ref_inputs = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    ref = per_document_attention(*ref_inputs, mb.document_ids)
    (ref[real] * weights.double()).sum().backward()
    torch.testing.assert_close(out.detach().double().cpu()[real], ref.detach()[real], rtol=2e-2, atol=2e-2)
    for got, want in zip((q, k, v), ref_inputs, strict=True):
        torch.testing.assert_close(got.grad.double().cpu(), want.grad, rtol=5e-2, atol=5e-2)
