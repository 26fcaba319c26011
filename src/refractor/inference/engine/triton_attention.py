"""Paged decode attention as one Triton kernel (CUDA only; imported lazily).

One program per (sequence, KV head): it loads the G query heads that share the KV head, walks
the sequence's context ``TILE`` tokens at a time (each token's slot found through the block
table, so a tile may span several KV blocks) with an online softmax, and writes G outputs. The
loop bound is the sequence's context length read on device, so the launch is CUDA-graph friendly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    stride_q_b,
    stride_q_h,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    stride_bt_b,
    stride_o_b,
    stride_o_h,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    n = tl.arange(0, TILE)
    g_mask = g < G
    q = tl.load(
        q_ptr + b * stride_q_b + (h * G + g)[:, None] * stride_q_h + d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )
    context_len = tl.load(context_lens_ptr + b)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp -> exp2
    for start in range(0, context_len, TILE):
        token = start + n
        valid = token < context_len
        block = tl.load(block_tables_ptr + b * stride_bt_b + token // BLOCK, mask=valid, other=0).to(tl.int64)
        offs = (
            block[:, None] * stride_cache_block
            + (token % BLOCK)[:, None] * stride_cache_tok
            + h * stride_cache_head
            + d[None, :]
        )
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + b * stride_o_b + (h * G + g)[:, None] * stride_o_h + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None],
    )


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    tile: int = 128,
    num_warps: int = 4,
) -> torch.Tensor:
    """q [B, H, D]; caches [num_blocks, block_size, H_kv, D]; block_tables [B, max_blocks] int32.
    ``tile``: context tokens per loop iteration (a power of two)."""
    batch, heads, dim = q.shape
    block_size = k_cache.shape[1]
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q)
    _paged_decode_kernel[(batch, kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        dim**-0.5,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        G=group,
        G_PAD=max(16, triton.next_power_of_2(group)),
        D=dim,
        BLOCK=block_size,
        TILE=tile,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays exact (no TF32)
        num_warps=num_warps,
        num_stages=2,
    )
    return out
