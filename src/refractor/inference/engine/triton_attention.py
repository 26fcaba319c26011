"""Paged decode attention as Triton kernels (CUDA only; imported lazily).

One program per (sequence, KV head, split): it loads the G query heads that share the KV head,
walks its share of the sequence's context ``TILE`` tokens at a time (each token's slot found
through the block table, so a tile may span several KV blocks) with an online softmax, and writes
G outputs. The loop bounds come from the sequence's context length read on device, so the launch
is CUDA-graph friendly.

Split-KV (flash-decoding): with few sequences there are too few (sequence, KV head) programs to
fill the GPU, and each walks a whole long context alone. Then the context is cut into ``SPLITS``
equal shares, each program writes its unnormalized output with its running max and sum, and a
second kernel merges the shares of every (sequence, head).
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
    part_acc_ptr,
    part_ml_ptr,
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
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
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
    # this program's share of the context, whole tiles (the last shares may be empty)
    share = tl.cdiv(tl.cdiv(context_len, SPLITS), TILE) * TILE
    lo = split * share
    hi = tl.minimum(lo + share, context_len)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp -> exp2
    for start in range(lo, hi, TILE):
        token = start + n
        valid = token < hi
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
    heads = h * G + g
    if SPLITS == 1:
        tl.store(
            out_ptr + b * stride_o_b + heads[:, None] * stride_o_h + d[None, :],
            (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None],
        )
    else:  # part_acc [B, H, SPLITS, D], part_ml [B, H, SPLITS, 2]: merged by _merge_splits_kernel
        row = (b * (tl.num_programs(1) * G) + heads) * SPLITS + split
        tl.store(part_acc_ptr + row[:, None] * D + d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    stride_o_b,
    stride_o_h,
    H: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """One program per (sequence, query head): the shares' outputs, each weighted by its sum
    rescaled to the largest max (an empty share has max -inf and weighs nothing)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    row = (b * H + h) * SPLITS + s
    m = tl.load(part_ml_ptr + row * 2)
    l_s = tl.load(part_ml_ptr + row * 2 + 1)
    acc = tl.load(part_acc_ptr + row[:, None] * D + d[None, :])
    m_max = tl.max(m, 0)
    w = tl.math.exp2(m - m_max)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(out_ptr + b * stride_o_b + h * stride_o_h + d, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    tile: int = 128,
    num_warps: int = 4,
    splits: int = 1,
) -> torch.Tensor:
    """q [B, H, D]; caches [num_blocks, block_size, H_kv, D]; block_tables [B, max_blocks] int32.
    ``tile``: context tokens per loop iteration (a power of two). ``splits``: context shares per
    (sequence, KV head), a power of two (``attention.split_count`` picks one for a batch)."""
    batch, heads, dim = q.shape
    block_size = k_cache.shape[1]
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits must be a power of two, got {splits}")
    out = torch.empty_like(q)
    part_acc = part_ml = out  # unused by the single-share kernel
    if splits > 1:
        part_acc = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch, heads, splits, 2, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(batch, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_acc,
        part_ml,
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
        SPLITS=splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays exact (no TF32)
        num_warps=num_warps,
        num_stages=2,
    )
    if splits > 1:
        _merge_splits_kernel[(batch, heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), H=heads, D=dim, SPLITS=splits, num_warps=1
        )
    return out
