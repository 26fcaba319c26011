"""Merged forward passes (``trainer.rows``): same samples, same step, fewer passes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from refractor.algorithms.attention import block_causal_mask
from refractor.trainer import Trainer
from refractor.trainer.rows import merge_rows

from ._helpers import make_cfg, make_samples, pack, quiet_env

quiet_env()


def test_merge_rows_concatenates_rows_into_passes_that_keep_samples_apart():
    samples = make_samples(n=9, seed=11)
    rows = pack(samples, num_dp_ranks=1).micro_batches[0]
    assert len(rows) >= 3
    passes = merge_rows(rows, max_tokens=256)
    assert len(passes) < len(rows) and all(p.num_tokens <= 256 for p in passes)
    assert sorted(i for p in passes for i in p.sample_ids) == sorted(s.sample_id for s in samples)
    for p in passes:
        members = [mb for mb in rows if set(mb.sample_ids) <= set(p.sample_ids)]
        assert sum(mb.num_tokens for mb in members) == p.num_tokens
        # The block-causal mask of the pass is the block-diagonal of its rows' masks.
        torch.testing.assert_close(block_causal_mask(p.document_ids),
                                   torch.block_diag(*[block_causal_mask(mb.document_ids) for mb in members]))
        assert p.cu_seqlens.tolist() == sorted(set(p.cu_seqlens.tolist())) and p.cu_seqlens[-1] == p.num_tokens
        assert int(p.document_ids.max()) + 1 == len(p.sample_ids)
    assert merge_rows(rows, max_tokens=0) == rows  # off
    assert len(merge_rows(rows, max_tokens=1)) == len(rows)  # nothing fits together: one pass per row


def test_merge_rows_drops_noop_rows_next_to_real_ones():
    batch = pack(make_samples(n=3, seed=12), num_dp_ranks=4)  # 3 samples over 4 ranks: one no-op row
    noop_rank = next(r for r in batch.micro_batches if r[0].is_noop)
    real_rank = next(r for r in batch.micro_batches if not r[0].is_noop)
    assert merge_rows(noop_rank + real_rank, 10_000) == [real_rank[0]]
    assert merge_rows(noop_rank + noop_rank, 10_000) == [noop_rank[0]]


def test_a_step_with_merged_passes_equals_the_step_with_one_pass_per_row(tiny_qwen2_path):
    """Merging is a CUDA default; on CPU it is forced here to compare against per-row passes."""
    batch = pack(make_samples(n=9, seed=13))
    runs = []
    for max_tokens in (0, 512):
        trainer = Trainer(make_cfg(tiny_qwen2_path, kl_penalty_tau=0.1))
        assert trainer.step_settings.max_tokens_per_forward == 0  # CPU default: one pass per row
        trainer.step_settings = replace(trainer.step_settings, max_tokens_per_forward=max_tokens)
        runs.append([trainer.train_step(batch).metrics for _ in range(2)])
    rows, merged = runs
    assert rows[0]["timing_microbatch_count"] > merged[0]["timing_microbatch_count"] == 1
    # Same gradients up to float32 summation order: equal metrics before and after the first update
    # (AdamW's first step is ~lr * sign(g), so parameters are compared through the second step's loss).
    for before, after in zip(rows, merged, strict=True):
        for key in ("loss", "grad_norm", "entropy", "kl_divergence_inference"):
            assert after[key] == pytest.approx(before[key], rel=1e-5), key
