"""The core attention of the Megatron trainer's layers: refractor's packed attention over a row's samples.

Megatron-Core's local layer spec computes attention with ``DotProductAttention``: a [heads, T, T] score
matrix and a dense [T, T] mask per row, unfused. ``PackedCoreAttention`` takes its place in the spec
(``SelfAttentionSubmodules.core_attention``) and runs what refractor's own model runs on each device,
``refractor.models.PackedAttention``: the varlen FlashAttention kernel over ``cu_seqlens`` on CUDA in
bf16/fp16, FlexAttention with a document mask on CUDA in float32, SDPA with a block-causal mask on
CPU. A token sees the earlier tokens of its own sample only; a padding token sees no real token.

The row's ``PackedAttention`` reaches every layer as the decoder's ``attention_mask`` argument, which
megatron-core hands from the block to each layer's self-attention and on to its core attention
untouched; it is built once per row, outside the checkpointed layers, so the recompute uses it too.

Context parallelism passes ``refractor.trainer.context_parallel.ContextParallelAttention`` in the same
place: the core attention then sees this CP rank's tokens, and the object attends them to the whole
row's keys and values (``forward.py``). Megatron-Core's own context parallelism (the Transformer Engine
attention's, ``TransformerConfig.context_parallel_size``) stays off.

Tensor parallelism needs nothing here: a rank's query, key and value hold its own heads and key/value
groups (``[T, 1, heads / TP, D]``). Grouped-query attention: Megatron-Core's fused QKV puts the query
heads of group g at ``[g * heads / groups, (g + 1) * heads / groups)``, the rule by which refractor's
backends repeat the key/value heads.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from refractor.models import PackedAttention
from refractor.trainer.context_parallel import ContextParallelAttention


class PackedCoreAttention(MegatronModule):
    """Megatron-Core's core-attention interface (``DotProductAttention``'s arguments) over one packed row
    ``[T, 1, heads, D]``; ``attention_mask`` is the row's ``PackedAttention`` (with context parallelism,
    its ``ContextParallelAttention``)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attention_type != "self" or config.context_parallel_size != 1:
            raise NotImplementedError(
                "refractor's packed core attention is causal self-attention; its context parallelism is "
                "refractor's (ContextParallelAttention), not Transformer Engine's"
            )
        if softmax_scale is not None or config.attention_dropout or attention_dropout:
            raise NotImplementedError(
                "refractor's packed core attention scales scores by 1/sqrt(head_dim) and has no dropout"
            )
        self.layer_index = layer_number - 1

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: PackedAttention | ContextParallelAttention,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """[T, 1, heads, D] query and [T, 1, groups, D] key/value -> [T, 1, heads * D]."""
        if not isinstance(attention_mask, PackedAttention | ContextParallelAttention):
            raise TypeError(
                "PackedCoreAttention takes the row's PackedAttention (or ContextParallelAttention) as the "
                "decoder's attention_mask, "
                f"got {type(attention_mask).__name__}"
            )
        if query.shape[1] != 1 or attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("PackedCoreAttention runs one packed row, without bias or THD params")
        out = attention_mask(query[:, 0], key[:, 0], value[:, 0], self.layer_index)
        return out.reshape(out.shape[0], 1, -1)
