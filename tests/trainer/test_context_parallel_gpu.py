"""Context parallelism's GPU attention path (GPU only): each rank's queries run torch's varlen
FlashAttention on per-sample segments against the gathered row, and must equal the block-causal
attention of the whole row at those positions (the CPU tests check the SDPA path and the ranks)."""

from __future__ import annotations

import pytest
import torch

from refractor.models.attention import block_causal_mask, masked_attention, varlen_attention_available
from refractor.trainer.context_parallel import ContextGroup, RowShard, shard_positions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("cp", [2, 4])
def test_varlen_segments_equal_the_rows_block_causal_attention(cp):
    assert varlen_attention_available()
    gen = torch.Generator().manual_seed(0)
    lengths = [700, 33, 1, 2000, 517, 845]  # samples crossing chunk boundaries, then padding
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    docs = torch.cat([docs, torch.full((-docs.numel() % (2 * cp * 64) or 64,), -1)]).cuda()
    t, heads, kv_heads, dim = docs.numel(), 14, 2, 64
    q, k, v = (torch.randn(t, h, dim, generator=gen).cuda() for h in (heads, kv_heads, kv_heads))
    reference = masked_attention(q.double(), k.double(), v.double(), block_causal_mask(docs))
    real = docs >= 0  # padding runs causally within its span on the varlen path: not compared
    for rank in range(cp):
        positions = shard_positions(t, cp, rank).cuda()
        shard = RowShard(ContextGroup(cp, rank), docs, positions, torch.arange(t, device="cuda"))
        qs = q[positions].bfloat16().requires_grad_()
        out = shard.attention().attend(qs, k.bfloat16(), v.bfloat16())
        keep = real[positions]
        torch.testing.assert_close(
            out[keep].double(), reference[positions][keep], rtol=0, atol=3e-2, msg=f"rank {rank}"
        )
        out.float().square().sum().backward()  # the backward runs (segments' key index gathers)
        assert qs.grad is not None and torch.isfinite(qs.grad).all()
