"""Chunked log-probs + entropy equal the naive full-logits computation (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from refractor.algorithms import chunked_logprobs_entropy, effective_temperature, token_logprobs_and_entropy


def naive(hidden, weight, targets, temperature):
    """The computation the chunked one replaces: full [N, V] logits, log_softmax, gather."""
    t = 1.0 if temperature == 0 else temperature
    logits = (hidden @ weight.t()).float() / t
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(1, targets[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def inputs(n=45, h=24, v=97, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype) * 0.7
    weight = torch.randn(v, h, generator=g, dtype=dtype) * 0.7
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 45, 1000, 0, -1])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_matches_naive_values_and_gradients(chunk_size, temperature):
    hidden, weight, targets = inputs()
    g = torch.Generator().manual_seed(1)
    w_lp = torch.randn(len(targets), generator=g)
    w_ent = torch.randn(len(targets), generator=g)

    h1 = hidden.clone().requires_grad_()
    W1 = weight.clone().requires_grad_()
    lp, ent = chunked_logprobs_entropy(h1, W1, targets, temperature=temperature, chunk_size=chunk_size)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()

    h2 = hidden.clone().requires_grad_()
    W2 = weight.clone().requires_grad_()
    lp_ref, ent_ref = naive(h2, W2, targets, temperature)
    ((lp_ref * w_lp).sum() + (ent_ref * w_ent).sum()).backward()

    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(W1.grad, W2.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("which", ["logprobs", "entropy"])
def test_single_output_gradients(which):
    """Only one output used (entropy bonus off, or metric only): the other grad is None inside."""
    hidden, weight, targets = inputs(n=20)
    h1 = hidden.clone().requires_grad_()
    W1 = weight.clone().requires_grad_()
    out = chunked_logprobs_entropy(h1, W1, targets, temperature=0.8, chunk_size=6)
    out[0 if which == "logprobs" else 1].sum().backward()
    h2 = hidden.clone().requires_grad_()
    W2 = weight.clone().requires_grad_()
    ref = naive(h2, W2, targets, 0.8)
    ref[0 if which == "logprobs" else 1].sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(W1.grad, W2.grad, rtol=0, atol=1e-5)


def test_gradcheck_float64():
    hidden, weight, targets = inputs(n=11, h=5, v=13, dtype=torch.float64)

    def f(h, w):
        lp, ent = chunked_logprobs_entropy(h, w, targets, temperature=0.7, chunk_size=4)
        return lp, ent

    assert torch.autograd.gradcheck(f, (hidden.requires_grad_(), weight.requires_grad_()))


def test_frozen_weight_and_no_grad():
    hidden, weight, targets = inputs(n=10)
    h = hidden.clone().requires_grad_()
    lp, _ = chunked_logprobs_entropy(h, weight, targets, chunk_size=3)
    lp.sum().backward()
    assert h.grad is not None and weight.grad is None
    with torch.no_grad():
        lp2, _ = chunked_logprobs_entropy(hidden, weight, targets, chunk_size=3)
    torch.testing.assert_close(lp2, lp.detach())


def test_token_alignment():
    """Value at t is log p(token t | tokens < t), read from hidden[t-1]; position 0 is 0."""
    hidden, weight, _ = inputs(n=12)
    ids = torch.randint(0, weight.shape[0], (12,), generator=torch.Generator().manual_seed(4))
    lp, ent = token_logprobs_and_entropy(hidden, weight, ids, temperature=0.9, chunk_size=5)
    ref_lp, ref_ent = naive(hidden[:-1], weight, ids[1:], 0.9)
    assert lp.shape == ent.shape == (12,)
    assert lp[0] == 0 and ent[0] == 0
    torch.testing.assert_close(lp[1:], ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent[1:], ref_ent, rtol=0, atol=1e-5)


def test_temperature_rules_and_errors():
    assert effective_temperature(0.0) == 1.0
    assert effective_temperature(0.7) == 0.7
    with pytest.raises(ValueError, match="temperature"):
        effective_temperature(-1.0)
    hidden, weight, targets = inputs(n=4)
    with pytest.raises(ValueError, match="targets"):
        chunked_logprobs_entropy(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="hidden"):
        chunked_logprobs_entropy(hidden, weight[:, :3], targets)


def test_bf16_inputs_follow_the_model_dtype():
    """bf16 hidden/weight: the matmul runs in bf16 (as the LM head does), softmax in fp32."""
    hidden, weight, targets = inputs(n=16)
    hb = hidden.bfloat16().requires_grad_()
    wb = weight.bfloat16().requires_grad_()
    lp, ent = chunked_logprobs_entropy(hb, wb, targets, chunk_size=5)
    ref_lp, ref_ent = naive(hb.detach(), wb.detach(), targets, 1.0)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.detach(), ref_lp, rtol=0, atol=1e-5)
    (lp.sum() + ent.sum()).backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
