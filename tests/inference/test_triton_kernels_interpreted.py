"""The engine's Triton kernels (fused sampler, paged decode attention) run by Triton's CPU
interpreter against the torch references: the kernels' logic is checked on every CI run, not only
on a GPU (tests/inference/test_sampler_gpu.py runs them compiled)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

SCRIPT = textwrap.dedent(
    """
    import torch
    from refractor.inference.engine.attention import paged_decode_attention_torch
    from refractor.inference.engine.sampler import process_logits
    from refractor.inference.engine.triton_attention import paged_decode_attention_triton
    from refractor.inference.engine.triton_sampler import sample_triton

    torch.manual_seed(0)
    # the interpreter runs each program in Python: few rows, small tiles; 16, 4 and 1 programs a row
    for rows, vocab, ranked in ((2, 1000, True), (65, 200, False)):
        logits = (torch.randn(rows, vocab) * 4).to(torch.bfloat16)
        temps = torch.tensor([0.0, 1.0, 0.7, 1.3]).repeat(rows)[:rows]
        tokens, logprobs, ranks = sample_triton(logits, temps, torch.arange(rows) * 7919, ranked, block=32)
        processed = process_logits(logits, temps)
        assert torch.equal(tokens[temps == 0], processed[temps == 0].argmax(-1))
        want = processed.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
        assert (logprobs - want).abs().max().item() < 1e-5
        if ranked:
            scaled = logits.float() * (1.0 / torch.where(temps == 0, 1.0, temps))[:, None]
            assert torch.equal(ranks.long(), (scaled > scaled.gather(1, tokens[:, None])).sum(-1) + 1)
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
    rows = 400
    seeds = torch.arange(rows) * 31 + 5
    tokens, _, _ = sample_triton(probs.log().repeat(rows, 1), torch.ones(rows), seeds, block=8)
    frequency = torch.bincount(tokens, minlength=8).double() / rows
    assert ((frequency - probs).abs() <= 4.5 * (probs * (1 - probs) / rows).sqrt() + 1e-9).all(), frequency
    again, _, _ = sample_triton(probs.log().repeat(50, 1), torch.ones(50), seeds[:50], block=8)
    assert torch.equal(again, tokens[:50])  # a seed gives the same draw, whatever the batch

    q = torch.randn(5, 14, 64)
    k_cache = torch.randn(40, 16, 2, 64)
    v_cache = torch.randn(40, 16, 2, 64)
    tables = torch.randperm(40)[:35].view(5, 7).int()
    lens = torch.tensor([1, 15, 16, 50, 112], dtype=torch.int32)
    ref = paged_decode_attention_torch(q, k_cache, v_cache, tables, lens)
    for tile in (16, 64):  # one KV block per iteration, and a tile across several
        out = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, tile=tile)
        assert (out - ref).abs().max().item() < 1e-4, tile
    # split-KV: shares of one tile each, and more shares than tiles (the empty ones weigh nothing)
    for splits in (2, 8):
        out = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, tile=16, splits=splits)
        assert (out - ref).abs().max().item() < 1e-4, splits
    print("ok")
    """
)


def test_the_kernels_match_their_references_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
