"""The engine's attention backends: the decoder's attention calls, plus a paged KV cache.

KV cache layout: one tensor ``[2 (k, v), layers, num_blocks, block_size, H_kv, D]``; a token's
slot is ``block * block_size + offset``. A prefill that starts at position 0 only needs the fresh
q/k/v of the step (padded-batch SDPA, causal); one that continues a cached prefix reads the whole
context back from the cache after writing its own k/v. Either way the k/v are written to the cache
for the decode steps that follow. Decode reads the cache through each sequence's block table: a
Triton kernel on CUDA, a gather + SDPA elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from refractor.inference.engine.checked_kernel import CheckedKernel
from refractor.models.attention import varlen_attention_available, varlen_causal_attention

# SDPA backends for the engine's prefills: not cuDNN, which builds an execution plan on the host for
# every new shape, and prefill shapes change with every step.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def write_kv(
    kv_cache: torch.Tensor | None, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    if kv_cache is None:  # memory profiling runs without a cache
        return
    heads = k.shape[1]
    dim = k.shape[2]
    kv_cache[0, layer].view(-1, heads, dim).index_copy_(0, slots, k)
    kv_cache[1, layer].view(-1, heads, dim).index_copy_(0, slots, v)


@dataclass
class PrefillAttention:
    """Causal attention within each of the step's sequences (laid out back to back in [T]).

    With ``cu_seqlens`` (on CUDA in bf16/fp16, once ``varlen_prefill_available``) the sequences go to
    the varlen FlashAttention kernel as they lie; else they are padded to ``max_len`` for SDPA, whose
    CUDA backends may build a plan for every new padded shape (cuDNN does, on the host).
    """

    kv_cache: torch.Tensor | None
    slot_mapping: torch.Tensor  # [T] int64
    batch_index: torch.Tensor  # [T] which sequence each token belongs to
    position_index: torch.Tensor  # [T] its position within that sequence
    num_seqs: int
    max_len: int
    cu_seqlens: torch.Tensor | None = None  # [num_seqs + 1] int32: where each sequence starts in [T]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int) -> torch.Tensor:
        write_kv(self.kv_cache, layer_index, self.slot_mapping, k, v)
        if self.cu_seqlens is not None:
            return varlen_causal_attention(q, k, v, self.cu_seqlens, self.max_len)
        if k.shape[1] != q.shape[1]:  # plain MHA keeps SDPA on its flash kernel
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        if self.num_seqs * self.max_len == q.shape[0]:  # equal lengths: a view, no padding copy

            def pad(x):
                return x.view(self.num_seqs, self.max_len, *x.shape[1:])
        else:

            def pad(x):
                out = x.new_zeros(self.num_seqs, self.max_len, *x.shape[1:])
                out[self.batch_index, self.position_index] = x
                return out

        # Right padding + is_causal: real queries never see the padded keys that follow them.
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(
                pad(q).transpose(1, 2), pad(k).transpose(1, 2), pad(v).transpose(1, 2), is_causal=True
            )
        out = out.transpose(1, 2)
        if self.num_seqs * self.max_len == q.shape[0]:
            return out.reshape(q.shape)
        return out[self.batch_index, self.position_index]


@dataclass
class CachedPrefixAttention:
    """Prefill of sequences whose first tokens' KV is cached already (a shared prompt prefix).

    The step's queries are the tokens after that prefix; they attend to the whole context, which
    is read back from the cache once the step's own k/v are in it.
    """

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64: the slots of the step's tokens
    batch_index: torch.Tensor  # [T] which sequence each token belongs to
    query_index: torch.Tensor  # [T] its index among that sequence's new tokens
    context_slots: torch.Tensor  # [S, L] int64: the slot of every context position (padding past it)
    mask: torch.Tensor  # [S, 1, Q, L] bool: what each (padded) query row may see
    num_seqs: int
    max_query_len: int

    @classmethod
    def build(
        cls,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        starts: list[int],
        ends: list[int],
        context_slots: torch.Tensor,
        device: torch.device,
    ) -> CachedPrefixAttention:
        """``starts[i]``/``ends[i]``: sequence i's first new position and its length; the step's
        tokens are every sequence's ``[start, end)`` back to back."""
        lens = torch.tensor(ends) - torch.tensor(starts)
        batch_index = torch.repeat_interleave(torch.arange(len(ends)), lens)
        query_index = torch.cat([torch.arange(n) for n in lens.tolist()])
        q_pos = torch.tensor(starts)[:, None] + torch.arange(int(lens.max()))  # [S, Q] absolute
        k_pos = torch.arange(context_slots.shape[1])
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos < torch.tensor(ends)[:, None])[:, None, :]
        return cls(
            kv_cache,
            slot_mapping,
            batch_index.to(device),
            query_index.to(device),
            context_slots.to(device),
            mask[:, None].to(device),
            len(ends),
            int(lens.max()),
        )

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int) -> torch.Tensor:
        write_kv(self.kv_cache, layer_index, self.slot_mapping, k, v)
        heads, dim = q.shape[1:]
        kv_heads = k.shape[1]
        keys = self.kv_cache[0, layer_index].view(-1, kv_heads, dim)[self.context_slots]  # [S, L, H_kv, D]
        values = self.kv_cache[1, layer_index].view(-1, kv_heads, dim)[self.context_slots]
        if kv_heads != heads:
            keys = keys.repeat_interleave(heads // kv_heads, dim=2)
            values = values.repeat_interleave(heads // kv_heads, dim=2)
        queries = q.new_zeros(self.num_seqs, self.max_query_len, heads, dim)
        queries[self.batch_index, self.query_index] = q
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(
                queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=self.mask
            )
        return out.transpose(1, 2)[self.batch_index, self.query_index]


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """Reference decode attention: gather each sequence's blocks, mask past its length, SDPA."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    k = k_cache[block_tables.long()].flatten(1, 2).transpose(1, 2)  # [B, H_kv, L, D]
    v = v_cache[block_tables.long()].flatten(1, 2).transpose(1, 2)
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < context_lens[:, None]
    qg = q.view(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :])
    return out.reshape(batch, heads, dim)


def _load_triton_decode(device: torch.device):
    from refractor.inference.engine.triton_attention import paged_decode_attention_triton

    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(5, 14, 64, device=device, dtype=torch.bfloat16, generator=gen)
    kc = torch.randn(40, 32, 2, 64, device=device, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(40, 32, 2, 64, device=device, dtype=torch.bfloat16, generator=gen)
    tables = torch.randperm(40, device=device, generator=gen)[:35].view(5, 7).int()
    lens = torch.tensor([1, 31, 32, 100, 224], device=device, dtype=torch.int32)
    ref = paged_decode_attention_torch(q, kc, vc, tables, lens)
    for splits in (1, 4):  # the whole context in one program, and split-KV
        err = (paged_decode_attention_triton(q, kc, vc, tables, lens, splits=splits) - ref).abs().max().item()
        if err > 2e-2:
            raise RuntimeError(f"with {splits} context shares it differs from the reference by {err}")
    return paged_decode_attention_triton


_triton_decode = CheckedKernel("Triton paged decode attention", "the torch gather path", _load_triton_decode)


def triton_decode_available(device: torch.device) -> bool:
    return _triton_decode.available(device)


def _load_varlen_prefill(device: torch.device):
    if not varlen_attention_available():
        raise RuntimeError("this torch has no varlen FlashAttention")
    gen = torch.Generator(device=device).manual_seed(0)
    lens = [1, 37, 64, 5]
    total = sum(lens)
    q = torch.randn(total, 14, 64, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(total, 2, 64, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(total, 2, 64, device=device, dtype=torch.bfloat16, generator=gen)
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    padded = PrefillAttention(None, seq, seq, pos, len(lens), max(lens))
    err = (
        PrefillAttention(None, seq, seq, pos, len(lens), max(lens), cu)(q, k, v, 0) - padded(q, k, v, 0)
    ).abs()
    if err.max().item() > 2e-2:
        raise RuntimeError(f"it differs from padded SDPA by {err.max().item()}")
    return varlen_causal_attention


_varlen_prefill = CheckedKernel("varlen FlashAttention prefill", "padded SDPA", _load_varlen_prefill)


def varlen_prefill_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether prefills without a cached prefix run the varlen kernel (CUDA, bf16/fp16, checked once)."""
    return dtype in (torch.bfloat16, torch.float16) and _varlen_prefill.available(device)


# Below this many context tokens a program's walk is short: one share per program.
SPLIT_KV_MIN_CONTEXT = 512


def split_count(batch: int, kv_heads: int, device: torch.device) -> int:
    """Context shares per (sequence, KV head) for split-KV decode: 1 once the (sequence, KV head)
    programs alone come within half of two per SM; else enough shares for two programs per SM,
    a power of two, at most 16."""
    programs = batch * kv_heads
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    if 2 * programs > target:
        return 1
    return min(16, 1 << (-(-target // programs) - 1).bit_length())


@dataclass
class DecodeAttention:
    """One new token per sequence, attending to its cached context through its block table."""

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [B] int64
    context_lens: torch.Tensor  # [B] int32, including the new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    use_triton: bool = False
    splits: int = 1  # context shares per (sequence, KV head) in the Triton kernel (split-KV)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int) -> torch.Tensor:
        write_kv(self.kv_cache, layer_index, self.slot_mapping, k, v)
        k_cache = self.kv_cache[0, layer_index]
        v_cache = self.kv_cache[1, layer_index]
        if self.use_triton:
            return _triton_decode(
                q, k_cache, v_cache, self.block_tables, self.context_lens, splits=self.splits
            )
        return paged_decode_attention_torch(q, k_cache, v_cache, self.block_tables, self.context_lens)
