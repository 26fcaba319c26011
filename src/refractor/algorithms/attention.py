"""Causal attention over packed samples that cannot see each other (block-diagonal mask).

``block_causal_attention`` is the reference implementation (plain SDPA with an explicit [T, T]
mask): the CPU backend and the oracle for faster backends. ``flex_block_causal_attention`` with a
``document_block_mask`` is the CUDA path (compiled FlexAttention, masked blocks skipped); on CPU it
runs FlexAttention's eager reference, which is how the tests compare it with the oracle.
Padding (document id -1) attends only to itself in both.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[T] document ids -> [T, T] bool mask, True where query t may attend to key s.

    Padding (document id -1) attends only to itself so no row is fully masked (no NaN).
    """
    t = document_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, None] == document_ids[None, :]
    pad = document_ids < 0
    eye = torch.eye(t, dtype=torch.bool, device=document_ids.device)
    return (causal & same & ~pad[:, None]) | (eye & pad[:, None])


def block_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """q: [H, T, D], k/v: [H_kv, T, D] (GQA: H a multiple of H_kv), document_ids: [T] -> [H, T, D]."""
    if k.shape[0] != q.shape[0]:
        rep = q.shape[0] // k.shape[0]
        k = k.repeat_interleave(rep, dim=0)
        v = v.repeat_interleave(rep, dim=0)
    mask = block_causal_mask(document_ids)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# ---- FlexAttention document mask (the fast path on CUDA) -------------------------------------
def document_block_mask(document_ids: torch.Tensor):
    """FlexAttention ``BlockMask`` with the same rule as ``block_causal_mask``.

    Build it once per packed row and reuse it in every layer (building it costs a kernel launch
    and a [T/128, T/128] block table).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    docs = document_ids

    def mask_mod(b, h, q_idx, kv_idx):
        dq = docs[q_idx]
        return (dq == docs[kv_idx]) & (q_idx >= kv_idx) & ((dq >= 0) | (q_idx == kv_idx))

    t = document_ids.shape[-1]
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=t, KV_LEN=t, device=document_ids.device)


_compiled_flex = None


def _flex():
    # Without torch.compile flex_attention runs an unfused reference (the whole score matrix);
    # compiled, it is a fused kernel that skips fully masked blocks. CPU keeps the eager path.
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def flex_block_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, scale: float | None = None
) -> torch.Tensor:
    """Same contract as ``block_causal_attention`` with a ``document_block_mask``: [H, T, D] -> [H, T, D]."""
    from torch.nn.attention.flex_attention import flex_attention

    gqa = k.shape[0] != q.shape[0]
    if q.is_cuda:
        return _flex()(q[None], k[None], v[None], block_mask=block_mask, scale=scale, enable_gqa=gqa)[0]
    with warnings.catch_warnings():  # the unfused eager path is deliberate off CUDA
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(q[None], k[None], v[None], block_mask=block_mask, scale=scale, enable_gqa=gqa)[
            0
        ]
