"""Attention backends the decoder calls: ``backend(q, k, v, layer_index) -> out``.

Every backend takes q ``[T, H, D]`` and k/v ``[T, H_kv, D]`` for the flat token stream of one
forward (rope already applied) and returns ``[T, H, D]``. The decoder never knows which one it
runs: training passes a ``PackedAttention`` (packed samples, block-causal), the inference engine
passes its KV-cache backend (``refractor.inference.engine.attention``).

Packed samples never attend to each other on any ``PackedAttention`` path: torch's FlashAttention
varlen kernel over ``cu_seqlens`` (CUDA in bf16/fp16 by default: nothing to compile, so a cold start
pays no kernel compilation for attention), FlexAttention with a document ``mask_mod`` (CUDA
otherwise), and SDPA with the explicit ``block_causal_mask`` (CPU, and the last fallback). All apply
one rule: causal inside a sample, nothing across samples. Padding (document id -1) attends only to
itself on the mask paths and causally within the trailing padding span on the varlen path (it is
one more sequence of ``cu_seqlens``); either way no row is fully masked (no NaN), and padding
carries no loss.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int
    ) -> torch.Tensor: ...


_compiled_flex: Any = None
_flex_broken = False
_varlen_broken = False


_varlen_found: tuple[Any, frozenset[str]] | None | bool = False  # False: not looked up yet


def _varlen_kernel() -> tuple[Any, frozenset[str]] | None:
    """torch's varlen FlashAttention and its keyword names (they changed across torch releases),
    or None where this torch has none. Looked up once, outside any compiled region (a
    ``PackedAttention`` asks when it is made), so a traced call only reads the global."""
    global _varlen_found
    if _varlen_found is False:
        _varlen_found = None
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            return None
        names = frozenset(inspect.signature(varlen_attn).parameters)
        if {"window_size", "is_causal"} & names:  # else no way to ask for causal attention
            _varlen_found = (varlen_attn, names)
    return _varlen_found  # type: ignore[return-value]


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """[T, H, D] tensors, causal within each ``cu_seqlens`` span -> [T, H, D] (torch's varlen
    FlashAttention: CUDA, bf16/fp16; see ``varlen_attention_available``).

    With ``cu_seqlens_k`` the key spans differ from the query spans: a span's queries are its
    keys' last tokens (causal alignment from the bottom right, FlashAttention's rule)."""
    kernel = _varlen_kernel()
    assert kernel is not None
    fn, names = kernel
    kwargs: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in names else {"is_causal": True}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in names:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
    if cu_seqlens_k is None:
        cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
    return fn(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, **kwargs)


def varlen_attention_available() -> bool:
    """Whether this torch has a varlen FlashAttention that can run causal (``varlen_causal_attention``)."""
    return _varlen_kernel() is not None


def _flex_attention():
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        # Automatic dynamic shapes (not dynamic=False): rows of a real run differ in length, and a
        # static kernel per length would recompile until Dynamo's limit, then run unfused.
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[T] document ids -> [T, T] bool mask, True where query t may attend to key s."""
    t = document_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, None] == document_ids[None, :]
    pad = document_ids < 0
    eye = torch.eye(t, dtype=torch.bool, device=document_ids.device)
    return (causal & same & ~pad[:, None]) | (eye & pad[:, None])


@dataclass
class PackedAttention:
    """Causal attention over samples packed in one row; samples never see each other.

    ``document_ids[t]`` is the sample index of token t (-1 on padding). On CUDA the default
    backend is the varlen FlashAttention kernel over ``cu_seqlens`` (bf16/fp16 inputs; it needs
    ``cu_seqlens`` and ``max_seqlen``), else FlexAttention with a document mask (built when this
    object is made, by a compiled kernel, and shared by all layers); ``backend="sdpa"`` (or a
    failure of the others) uses SDPA with an explicit block-causal mask, which is also the CPU path.
    """

    document_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    backend: str = "auto"  # auto | varlen | flex | sdpa
    _block_mask: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # Build the block mask now, with a compiled kernel: eager create_block_mask costs more than
        # the whole forward on long rows, and a mask made lazily inside the first (checkpointed)
        # layer would not be recomputed by activation checkpointing. Not when the varlen kernel will
        # run: it needs no mask (a fallback from it builds one then, uncompiled).
        if (
            self._block_mask is None
            and self.document_ids.is_cuda
            and self._wants_flex()
            and not self._varlen_ready()
        ):
            self._block_mask = self._build_block_mask(compiled=True)

    def _varlen_ready(self) -> bool:
        if self.backend == "varlen":
            return True
        return (
            self.backend == "auto"
            and self.document_ids.is_cuda
            and self.cu_seqlens is not None
            and bool(self.max_seqlen)
            and not _varlen_broken
            and _varlen_kernel() is not None
        )

    def _wants_flex(self) -> bool:
        return self.backend == "flex" or (self.backend == "auto" and not _flex_broken)

    def _build_block_mask(self, compiled: bool) -> Any:
        global _flex_broken
        from torch.nn.attention.flex_attention import create_block_mask

        docs = self.document_ids

        def document_causal(b, h, q_idx, kv_idx):
            # Padding (-1) attends only to itself, exactly as the SDPA reference mask.
            same_doc = (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx) & (docs[q_idx] >= 0)
            return same_doc | (q_idx == kv_idx)

        t = docs.shape[0]
        try:
            return create_block_mask(document_causal, None, None, t, t, device=docs.device, _compile=compiled)
        except Exception as err:
            if self.backend == "flex":
                raise
            _flex_broken = True
            log.warning(
                "FlexAttention block mask failed (%s); falling back to SDPA with a block-causal mask", err
            )
            return None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int) -> torch.Tensor:
        global _flex_broken, _varlen_broken
        if self._varlen_ready() and (self.backend == "varlen" or q.dtype in (torch.bfloat16, torch.float16)):
            if self.cu_seqlens is None or not self.max_seqlen:
                raise ValueError("the varlen attention backend needs cu_seqlens and max_seqlen")
            if self.backend == "varlen" or torch.compiler.is_compiling():
                return varlen_causal_attention(q, k, v, self.cu_seqlens, self.max_seqlen)
            try:
                return varlen_causal_attention(q, k, v, self.cu_seqlens, self.max_seqlen)
            except Exception as err:  # an old GPU or an unsupported head size: the others are exact too
                _varlen_broken = True
                log.warning("varlen FlashAttention failed (%s); falling back to FlexAttention", err)
        if self._block_mask is not None and torch.compiler.is_compiling():
            # Inside a compiled decoder layer: FlexAttention is traced into the layer's graph
            # (no nested compiled call, no Python fallback logic for Dynamo to trace).
            return _flex_call(_raw_flex_attention(), q, k, v, self._block_mask)
        use_flex = self.backend == "flex" or (self.backend == "auto" and q.is_cuda and not _flex_broken)
        if use_flex:
            try:
                return self._flex(q, k, v)
            except Exception as err:  # an old torch or an unsupported shape: the SDPA path is exact too
                if self.backend == "flex":
                    raise
                _flex_broken = True
                log.warning("FlexAttention failed (%s); falling back to SDPA with a block-causal mask", err)
        return masked_attention(q, k, v, block_causal_mask(self.document_ids))

    def _flex(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._block_mask is None:
            self._block_mask = self._build_block_mask(compiled=False)
            if self._block_mask is None:
                raise RuntimeError("no FlexAttention block mask")
        return _flex_call(_flex_attention(), q, k, v, self._block_mask)


def _raw_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def _flex_call(flex, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """[T, H, D] tensors -> FlexAttention over one row ([1, H, T, D]) -> [T, H, D]."""
    out = flex(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=block_mask,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out[0].transpose(0, 1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[T, H, D] tensors -> SDPA with a [T, T] bool mask -> [T, H, D].

    GQA repeats the k/v heads instead of ``enable_gqa``: SDPA kernels that take an explicit mask
    do not all support grouped heads and would drop to the unfused math kernel.
    """
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


@dataclass
class CausalAttention:
    """One causal sequence (no packing): SDPA with ``is_causal``. Handy for scoring and tests."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        return out.transpose(0, 1)
