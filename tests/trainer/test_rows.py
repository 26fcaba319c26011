"""Merged forward passes (``trainer.rows``): same samples, same step, fewer passes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from refractor.models.attention import block_causal_mask
from refractor.trainer import Trainer
from refractor.trainer.rows import merge_rows, pad_row

from ._helpers import make_samples, make_settings, pack, quiet_env

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
        torch.testing.assert_close(
            block_causal_mask(p.document_ids),
            torch.block_diag(*[block_causal_mask(mb.document_ids) for mb in members]),
        )
        assert (
            p.cu_seqlens.tolist() == sorted(set(p.cu_seqlens.tolist())) and p.cu_seqlens[-1] == p.num_tokens
        )
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
    for max_tokens, pad_multiple in ((0, 0), (512, 0), (512, 160)):
        trainer = Trainer(make_settings(tiny_qwen2_path, kl_penalty_tau=0.1))
        assert trainer.step_settings.max_tokens_per_forward == 0  # CPU default: one pass per row
        assert trainer.step_settings.pass_pad_multiple == 0  # padding only for compiled (CUDA) layers
        trainer.step_settings = replace(
            trainer.step_settings, max_tokens_per_forward=max_tokens, pass_pad_multiple=pad_multiple
        )
        runs.append([trainer.train_step(batch).metrics for _ in range(2)])
    rows, merged, padded = runs
    assert rows[0]["timing_microbatch_count"] > merged[0]["timing_microbatch_count"] == 1
    tokens = merged[0]["trainer/batch/tokens"]
    assert padded[0]["trainer/batch/tokens"] == tokens + (-tokens % 160) > tokens  # the padding ran too
    # Same gradients up to float32 summation order: equal metrics before and after the first update
    # (AdamW's first step is ~lr * sign(g), so parameters are compared through the second step's loss).
    for run in (merged, padded):
        for before, after in zip(rows, run, strict=True):
            for key in ("loss", "grad_norm", "entropy", "kl_divergence_inference"):
                assert after[key] == pytest.approx(before[key], rel=1e-5), key


def test_pad_row_appends_one_isolated_segment_that_the_loss_ignores():
    row = pack(make_samples(n=3, seed=14)).micro_batches[0][0]
    n = row.num_tokens
    padded = pad_row(row, 128, pad_token_id=7)
    pad = padded.num_tokens - n
    assert padded.num_tokens % 128 == 0 and 0 < pad < 128
    assert padded.input_ids[n:].eq(7).all() and padded.document_ids[n:].eq(-1).all()
    assert padded.loss_mask[n:].eq(0).all() and padded.advantages[n:].eq(0).all()
    assert padded.position_ids[n:].tolist() == list(range(pad))
    assert padded.cu_seqlens.tolist() == [*row.cu_seqlens.tolist(), padded.num_tokens]
    for name in ("input_ids", "position_ids", "document_ids", "loss_mask", "advantages", "rollout_logprobs"):
        torch.testing.assert_close(getattr(padded, name)[:n], getattr(row, name))
    # the real tokens attend exactly as before; each padding token only to itself
    mask = block_causal_mask(padded.document_ids)
    torch.testing.assert_close(mask[:n, :n], block_causal_mask(row.document_ids))
    assert not mask[n:, :n].any() and not mask[:n, n:].any()
    assert pad_row(padded, 128, 7) is padded and pad_row(row, 0, 7) is row


def test_passes_are_merged_on_cuda_and_padded_only_for_compiled_layers(tiny_qwen2_path):
    from refractor.trainer.step import StepSettings

    settings = make_settings(
        tiny_qwen2_path, trainer_max_tokens_per_forward=8192, trainer_pass_pad_multiple=2048
    )
    compiled = StepSettings.from_settings(settings, pad_token_id=0, on_cuda=True, compiled=True)
    assert (compiled.max_tokens_per_forward, compiled.pass_pad_multiple) == (8192, 2048)
    eager = StepSettings.from_settings(settings, pad_token_id=0, on_cuda=True, compiled=False)
    assert (eager.max_tokens_per_forward, eager.pass_pad_multiple) == (8192, 0)
    cpu = StepSettings.from_settings(settings, pad_token_id=0, on_cuda=False)
    assert (cpu.max_tokens_per_forward, cpu.pass_pad_multiple) == (0, 0)


def compiled_lengths(tiny_qwen2_path, monkeypatch, pad_multiple: int) -> list[tuple[int, ...]]:
    """Token lengths of the graphs Dynamo compiles for the decoder layers over steps whose passes differ
    in length (CPU: Dynamo + AOTAutograd with the ``aot_eager`` backend, as Inductor would be fed on a
    GPU)."""
    import functools

    import torch._dynamo
    from torch._dynamo.backends.debugging import aot_eager

    graphs: list[tuple[int, ...]] = []

    def recording_backend(gm, example_inputs, **kwargs):
        sizes = [x.shape for x in example_inputs if isinstance(x, torch.Tensor)]
        assert all(isinstance(d, int) for shape in sizes for d in shape), "a dynamic-shape graph was compiled"
        graphs.append(sizes[0][0] if sizes and sizes[0] else None)  # the hidden states [T, H] come first
        return aot_eager(gm, example_inputs, **kwargs)

    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=recording_backend))
    trainer = Trainer(make_settings(tiny_qwen2_path, trainer_pass_pad_multiple=pad_multiple), compile=True)
    assert trainer.step_settings.pass_pad_multiple == pad_multiple
    trainer.step_settings = replace(trainer.step_settings, max_tokens_per_forward=256)
    for seed in (21, 22, 23, 21, 22):  # five steps, three batches of different pass lengths
        trainer.train_step(pack(make_samples(n=7, seed=seed)))
    torch._dynamo.reset()
    return graphs


def test_compiled_layers_see_only_the_padded_static_lengths(tiny_qwen2_path, monkeypatch):
    """Why passes are padded (``trainer_pass_pad_multiple``): every distinct pass length is one more
    compile of the decoder layer (static graphs: a dynamic-shape compile is impractically slow).
    Padded to multiples of 128, these steps compile fewer lengths, all multiples of 128, and
    batches seen before compile nothing new."""
    padded = compiled_lengths(tiny_qwen2_path, monkeypatch, 128)
    raw = compiled_lengths(tiny_qwen2_path, monkeypatch, 0)
    assert padded and all(t % 128 == 0 for t in padded)
    assert len(padded) == len(set(padded)) < len(raw) == len(set(raw))


def test_a_compiled_step_with_padded_passes_equals_the_eager_step(tiny_qwen2_path, monkeypatch):
    """The CUDA default's structure on CPU: layers compiled with their checkpoint inside (Dynamo +
    AOTAutograd, ``aot_eager``), merged and padded passes, and a no-grad pass for the ratio reference
    (``ppo_clip_ref_logprobs: batch``): the same metrics as eager layers on unmerged rows."""
    import functools

    import torch._dynamo

    settings = make_settings(
        tiny_qwen2_path, use_ppo_clip=True, ppo_clip_ref_logprobs="batch", trainer_pass_pad_multiple=128
    )
    batches = [pack(make_samples(n=7, seed=seed)) for seed in (31, 32)]
    eager = Trainer(settings)
    expected = [eager.train_step(b).metrics for b in batches]
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    compiled = Trainer(settings, compile=True)
    compiled.step_settings = replace(compiled.step_settings, max_tokens_per_forward=256)
    assert compiled.step_settings.batch_ref_logprobs
    got = [compiled.train_step(b).metrics for b in batches]
    torch._dynamo.reset()
    for before, after in zip(expected, got, strict=True):
        assert after["trainer/batch/tokens"] > before["trainer/batch/tokens"]  # the padding ran
        for key in ("loss", "grad_norm", "entropy", "kl_divergence_inference"):
            assert after[key] == pytest.approx(before[key], rel=1e-5), key
