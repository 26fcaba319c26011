"""One packed row through this rank's part of a Megatron-Core ``GPTModel``, and the log-probs at its end.

The model's own pieces run in order (embedding on the first stage, the decoder's layers, the final
norm and the head on the last), with two inputs ``GPTModel.forward`` would build differently:

* the attention: the row's ``PackedAttention`` (its samples' document ids and ``cu_seqlens``) goes in
  as the decoder's ``attention_mask``, which megatron-core hands to every layer's core attention,
  ``attention.PackedCoreAttention``: a token sees the earlier tokens of its own sample only, as in
  refractor's own model, and no [T, T] mask is built on a GPU;
* the rotary table is indexed by each token's position in its sample (``position_ids`` restart at 0
  for every sample), from the model's own frequencies (``get_freqs_non_repeated``), laid out as
  ``RotaryEmbedding.get_emb`` lays it out (which also moves them to a CUDA device).

With sequence parallelism (``sequence_parallel.py``) the embedding's output is split along the
sequence before the decoder, stages send each other their TP rank's block, and the last stage gathers
the final norm's output back before the head; the rotary table and the attention stay the whole pass's
(the layers' attention runs on the gathered sequence).

With context parallelism the row's ``RowShard`` (``refractor.trainer.context_parallel``, the FSDP
trainer's split) gives this rank its tokens: the embedding, the rotary table (each token's position in
its sample) and every layer run on them, and the attention is ``ContextParallelAttention``: this rank's
queries against the whole row's keys and values, gathered from the CP group in every layer (their
gradients go back to the ranks that hold them). The last stage computes the log-prob of the token after
each of its tokens and gathers them into the whole row (``RowShard.token_values``). Under sequence
parallelism too, a TP rank's block is a block of its CP rank's tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refractor.megatron.parallel import MegatronRanks
from refractor.megatron.sequence_parallel import gather_sequence, scatter_sequence
from refractor.megatron.vocab_parallel import vocab_parallel_logprobs_entropy, vocab_parallel_token_logprobs
from refractor.models import PackedAttention
from refractor.records import MicroBatch
from refractor.trainer.context_parallel import ContextParallelAttention, RowShard


def packed_attention(
    mb: MicroBatch, shard: RowShard | None = None
) -> PackedAttention | ContextParallelAttention:
    """The row's attention: causal within each sample (``document_ids``, ``cu_seqlens``); with
    ``shard``, this CP rank's queries over the whole row."""
    if shard is not None:
        return shard.attention()
    return PackedAttention(
        document_ids=mb.document_ids, cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen or None
    )


def rotary_table(model, mb: MicroBatch, shard: RowShard | None = None) -> torch.Tensor:
    """[T, 1, 1, D] (with ``shard``, this CP rank's tokens): the rotary angles of each token's position.
    ``max_seqlen`` (the longest span of ``cu_seqlens``) bounds every position, so the table's length is
    known without reading the device."""
    positions = mb.position_ids if shard is None else shard.local(mb.position_ids)
    rotary = model.rotary_pos_emb
    length = mb.max_seqlen or int(mb.position_ids.max()) + 1
    freqs = rotary.get_freqs_non_repeated(length).to(mb.position_ids.device)
    return torch.cat([freqs, freqs], dim=-1)[positions][:, None, None, :]


def stage_forward(
    model,
    mb: MicroBatch,
    received: torch.Tensor | None,
    sequence_group: dist.ProcessGroup | None = None,
    shard: RowShard | None = None,
) -> torch.Tensor:
    """This stage's output for the row: hidden states [T, 1, H] (with ``shard``, this CP rank's T / CP
    tokens; with ``sequence_group``, the TP group under sequence parallelism: this rank's block of them,
    [T / TP, 1, H]), after the final norm on the last stage. ``received``: the previous stage's output
    (None on the first stage)."""
    if model.pre_process:
        input_ids, position_ids = mb.input_ids, mb.position_ids
        if shard is not None:
            input_ids, position_ids = shard.local(input_ids), shard.local(position_ids)
        hidden = model.embedding(input_ids=input_ids[None], position_ids=position_ids[None])
        if sequence_group is not None:
            hidden = scatter_sequence(hidden, sequence_group)
    else:
        model.set_input_tensor(received)
        hidden = received
    return model.decoder(
        hidden_states=hidden,
        attention_mask=packed_attention(mb, shard),
        rotary_pos_emb=rotary_table(model, mb, shard),
    )


def head_weight(model, vocab_size: int, ranks: MegatronRanks) -> tuple[torch.Tensor, int]:
    """(this rank's rows of the LM head that are tokens, the vocabulary id of the first): the padded
    vocabulary's rows beyond ``vocab_size`` are left out."""
    weight = model.output_layer.weight
    if weight is None:  # tied on one stage: the head is the embedding
        weight = model.shared_embedding_or_output_weight()
    rows = weight.shape[0]
    start = ranks.tensor_rank * rows
    return weight[: max(0, min(rows, vocab_size - start))], start


def row_logprobs(
    model,
    hidden: torch.Tensor,
    mb: MicroBatch,
    vocab_size: int,
    ranks: MegatronRanks,
    temperature: float,
    chunk_size: int,
    sequence_parallel: bool = False,
    shard: RowShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last stage's per-token (log-prob, entropy) [T] of the row, the same on every TP and CP rank.
    ``sequence_parallel``: ``hidden`` is this rank's block of the sequence; ``shard``: of this CP rank's
    tokens, whose values are gathered into the row (each CP rank keeps its tokens' gradients)."""
    from megatron.core import tensor_parallel

    # every TP rank computes the head on the same hidden states; backward sums the ranks' shares
    if sequence_parallel:
        hidden = gather_sequence(hidden, ranks.tensor_group)
    else:
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=ranks.tensor_group)
    weight, start = head_weight(model, vocab_size, ranks)
    if shard is not None:
        logprobs, entropy = vocab_parallel_logprobs_entropy(
            hidden[:, 0],
            weight,
            start,
            shard.next_tokens(mb.input_ids),
            ranks.tensor_group,
            temperature=temperature,
            chunk_size=chunk_size,
        )
        return shard.token_values(logprobs), shard.token_values(entropy)
    return vocab_parallel_token_logprobs(
        hidden[:, 0],
        weight,
        start,
        mb.input_ids,
        ranks.tensor_group,
        temperature=temperature,
        chunk_size=chunk_size,
    )
