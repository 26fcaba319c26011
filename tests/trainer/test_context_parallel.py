"""Context parallelism: ranks sharing each packed row train exactly as one rank holding it.

The multi-rank test runs 4 gloo ranks as 2 data-parallel x 2 context-parallel groups and compares
losses, gradients and parameters with one rank on the same global batch (float32, rel/abs 1e-5).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp

from refractor.models.attention import block_causal_mask
from refractor.trainer import Trainer
from refractor.trainer.context_parallel import query_segments, row_mask, shard_positions

from ._helpers import (
    first_minibatch_gradients,
    free_port,
    full_params,
    make_samples,
    make_settings,
    pack,
    quiet_env,
)

quiet_env()
CP = 2
DP = 2


def test_zig_zag_shards_cover_the_row_once_and_balance_early_and_late_chunks():
    length, size = 48, 3
    held = [shard_positions(length, size, r) for r in range(size)]
    assert sorted(torch.cat(held).tolist()) == list(range(length))
    chunk = length // (2 * size)
    assert held[0].tolist() == [*range(0, chunk), *range(5 * chunk, 6 * chunk)]
    assert held[2].tolist() == [*range(2 * chunk, 3 * chunk), *range(3 * chunk, 4 * chunk)]
    with pytest.raises(ValueError, match="multiple of 6"):
        shard_positions(50, size, 0)


def _row_ids() -> torch.Tensor:
    # samples of 5, 9, 1, 7 tokens, then padding: samples cross every chunk boundary
    return torch.tensor([0] * 5 + [1] * 9 + [2] + [3] * 7 + [-1] * 2)


def test_the_rank_mask_is_the_rows_block_causal_mask_at_its_positions():
    docs = _row_ids()
    full = block_causal_mask(docs)
    for rank in range(CP):
        positions = shard_positions(docs.numel(), CP, rank)
        assert torch.equal(row_mask(docs, positions), full[positions])


def test_varlen_segments_give_each_query_exactly_its_samples_keys_up_to_itself():
    """The GPU path's segments, expanded with FlashAttention's bottom-right causal rule, equal the
    block-causal mask (padding: causal within the padding span, as the varlen path runs it)."""
    docs = _row_ids()
    t = docs.numel()
    spans = torch.cumsum(torch.cat([torch.tensor([1]), (docs[1:] != docs[:-1]).long()]), 0)
    reference = torch.ones(t, t, dtype=torch.bool).tril() & (spans[:, None] == spans[None, :])
    for rank in range(CP):
        positions = shard_positions(t, CP, rank)
        index, cu_q, cu_k, max_q, max_k = query_segments(docs, positions)
        seen = torch.zeros(positions.numel(), t, dtype=torch.bool)
        for s in range(len(cu_q) - 1):
            q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
            keys = index[k0:k1]
            for j in range(q1 - q0):  # query j of the segment sees keys[: len(keys) - (q1 - q0) + j + 1]
                seen[q0 + j, keys[: k1 - k0 - (q1 - q0) + j + 1]] = True
        assert torch.equal(seen, reference[positions]), rank
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())


def test_segments_are_never_traced_by_the_compiled_layers():
    """The varlen segments come from a Python loop over the row: under the compiled decoder layers
    Dynamo would unroll it (a 32k row did not finish a step). It is excluded from tracing, and a
    compiled caller still gets the eager result."""
    from torch._dynamo.testing import CompileCounter

    docs = _row_ids()
    positions = shard_positions(docs.numel(), CP, 0)
    counter = CompileCounter()
    compiled = torch.compile(lambda d, p: query_segments(d, p)[1] * 1, backend=counter, fullgraph=False)
    torch._dynamo.reset()
    assert torch.equal(compiled(docs, positions), query_segments(docs, positions)[1])
    assert counter.op_count <= 1  # at most the multiply after the call: nothing of the loop was captured


def _settings(model_path, **keys):
    return make_settings(model_path, weight_decay=0.01, **keys)


def _batches(dp: int):
    return [pack(make_samples(n=7, seed=40 + i), num_dp_ranks=dp, step=i) for i in range(2)]


def _run(trainer: Trainer, dp: int) -> dict:
    batches = _batches(dp)
    result = {"grads": first_minibatch_gradients(trainer, batches[0])}
    result["metrics"] = [trainer.train_step(b).metrics for b in batches]
    result["params"] = full_params(trainer)
    return result


def _worker(rank: int, world: int, port: int, model_path: str, loss: str, out: str) -> None:
    quiet_env()
    trainer = Trainer(
        _settings(model_path, algorithm=loss, fsdp_context_parallel_size=CP), rank, world, master_port=port
    )
    assert (trainer.dp_size, trainer.dp_rank, trainer.context.rank) == (DP, rank // CP, rank % CP)
    torch.save(_run(trainer, DP), f"{out}.rank{rank}")
    trainer.shutdown()


@pytest.mark.parametrize("loss", ["grpo", "gspo"])  # token-level and sequence-level ratios
def test_two_by_two_context_parallel_ranks_equal_one_rank(loss, tiny_qwen2_path, tmp_path):
    out = str(tmp_path / "result")
    world = DP * CP
    mp.spawn(_worker, args=(world, free_port(), str(tiny_qwen2_path), loss, out), nprocs=world, join=True)
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(world)]
    single = _run(Trainer(_settings(tiny_qwen2_path, algorithm=loss)), dp=1)

    for name, want in single["grads"].items():
        torch.testing.assert_close(ranks[0]["grads"][name], want, rtol=1e-5, atol=1e-7, msg=name)
    for got, want in zip(ranks[0]["metrics"], single["metrics"], strict=True):
        for key in ("loss", "grad_norm", "entropy", "kl_divergence_inference"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        assert got["trainer/batch/trainable_tokens"] == want["trainer/batch/trainable_tokens"]
    for result in ranks[1:]:  # every rank reports the same step metrics
        assert result["metrics"][1]["loss"] == ranks[0]["metrics"][1]["loss"]
    for name, p in single["params"].items():
        torch.testing.assert_close(ranks[-1]["params"][name], p, rtol=0, atol=1e-5, msg=name)


def test_context_parallelism_refuses_a_world_it_does_not_divide(tiny_qwen2_path):
    with pytest.raises(ValueError, match=r"fsdp_context_parallel_size \(2\) must divide .* \(1\)"):
        Trainer(replace(_settings(tiny_qwen2_path), fsdp_context_parallel_size=2))


def test_context_parallelism_needs_the_native_model():
    from refractor.trainer.context_parallel import ContextGroup
    from refractor.trainer.policy_model import PolicyModel

    with pytest.raises(ValueError, match="needs the native model"):
        PolicyModel(torch.nn.Linear(2, 2), "hf", ContextGroup(2, 0))
