"""The fused Triton sampler on a GPU against the torch path: greedy rows are the argmax, log-probs
are the processed log-softmax, draws follow softmax(logits / T), and a row's draw depends on its
seed alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from refractor.inference.engine.sampler import (
    Sampler,
    SamplingBatch,
    fused_sampler_available,
    process_logits,
    step_seeds,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _batch(temps, seeds, top_ps=None, logprobs=None) -> SamplingBatch:
    rows = len(temps)
    return SamplingBatch(
        list(temps),
        top_ps or [1.0] * rows,
        [0] * rows,
        [None] * rows,
        [logprobs] * rows,
        np.asarray(seeds, np.int64),
    )


def test_the_fused_kernel_is_used_and_matches_the_processed_log_softmax():
    assert fused_sampler_available(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(64, 151936, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    temps = [0.0, 1.0, 0.6, 1.5] * 16
    out = Sampler()(logits, _batch(temps, step_seeds(np.arange(64), np.zeros(64, np.int64))))
    processed = process_logits(logits, torch.tensor(temps, device="cuda"))
    logprobs = processed.log_softmax(-1)
    tokens = torch.tensor(out.token_ids, device="cuda")
    want = logprobs.gather(1, tokens[:, None])[:, 0]
    assert (torch.tensor(out.logprobs, device="cuda") - want).abs().max().item() < 1e-4
    greedy = [i for i, t in enumerate(temps) if t == 0]
    assert tokens[greedy].tolist() == processed[greedy].argmax(-1).tolist()
    # logprobs=0 asks for the sampled token's rank as well: the fused kernel counts it
    ranked = Sampler()(logits, _batch(temps, step_seeds(np.arange(64), np.zeros(64, np.int64)), logprobs=0))
    assert ranked.token_ids == out.token_ids
    inverse = 1.0 / torch.where(
        torch.tensor(temps, device="cuda") == 0, 1.0, torch.tensor(temps, device="cuda")
    )
    scaled = logits.float() * inverse[:, None]  # the kernel's arithmetic: ranks count on these values
    assert ranked.ranks == ((scaled > scaled.gather(1, tokens[:, None])).sum(-1) + 1).tolist()


def test_draws_follow_the_softmax():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005], device="cuda")
    rows = 200_000
    logits = (probs.log() * 0.5).repeat(rows, 1)  # at T=0.5 the distribution is probs again
    out = Sampler()(logits, _batch([0.5] * rows, step_seeds(np.arange(rows) + 11, np.zeros(rows, np.int64))))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).double() / rows
    # 4.5 standard errors of a binomial proportion, per token
    bound = 4.5 * (probs.double().cpu() * (1 - probs.double().cpu()) / rows).sqrt()
    assert ((counts - probs.double().cpu()).abs() <= bound).all(), (counts, probs)


def test_a_rows_draw_depends_on_its_seed_alone():
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(32, 50000, device="cuda", generator=gen)
    seeds = step_seeds(np.arange(32) * 31, np.full(32, 5, np.int64))
    together = Sampler()(logits, _batch([1.0] * 32, seeds)).token_ids
    alone = [Sampler()(logits[i : i + 1], _batch([1.0], seeds[i : i + 1])).token_ids[0] for i in range(32)]
    assert together == alone
    # a row that asks for top-p goes through torch ops; the others keep their fused draws
    mixed = Sampler()(logits, _batch([1.0] * 32, seeds, top_ps=[0.9] + [1.0] * 31)).token_ids
    assert mixed[1:] == together[1:]
    other = step_seeds(np.arange(32) * 31, np.full(32, 6, np.int64))  # the next position
    assert Sampler()(logits, _batch([1.0] * 32, other)).token_ids != together
