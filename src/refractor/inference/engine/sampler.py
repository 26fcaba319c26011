"""Batched sampling and the log-probs it reports.

Log-probs are "processed" (vLLM's ``--logprobs-mode processed_logprobs``): the log-softmax of
the logits after temperature scaling and top-k / top-p masking, i.e. of the distribution the
token was actually drawn from, which is what the trainer recomputes (logits / T). Greedy rows
(temperature 0) use temperature 1. ``process_logits`` is the single definition of that
transform; the trainer side can call it to reproduce the engine's numbers exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k and nucleus (same rule as vLLM/HF).

    top_k: [B] int (<= 0 or >= V = off); top_p: [B] float (1.0 = off). Returns a new tensor.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab)).long()
        kth_largest = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= (1 - top_p)[:, None]
        outside[:, -1] = False  # always keep the most likely token
        sorted_logits.masked_fill_(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 logits of the sampling distribution: ``logits / T`` (T=0 -> 1), then top-k, then top-p."""
    logits = logits.float()
    if isinstance(temperature, torch.Tensor):
        t = torch.where(temperature == 0, 1.0, temperature).to(logits)
        logits = logits / t[:, None]
    elif temperature not in (0, 1):
        logits = logits / temperature
    if top_k is not None or top_p is not None:
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return logits


@dataclass
class SamplingBatch:
    """Per-row settings of one step, gathered from the scheduled sequences."""

    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    generators: list[torch.Generator | None]
    num_top_logprobs: list[int | None]  # None: no ranks / alternatives for that row


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int] | None
    top_logprobs: list[list[tuple[int, float]]] | None


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        device = logits.device
        rows = logits.shape[0]
        temps = batch.temperatures
        temperature = temps[0] if len(set(temps)) == 1 else torch.tensor(temps, device=device)
        top_k = torch.tensor(batch.top_ks, device=device) if any(k > 0 for k in batch.top_ks) else None
        top_p = torch.tensor(batch.top_ps, device=device) if any(p < 1 for p in batch.top_ps) else None
        processed = process_logits(logits, temperature, top_k, top_p)
        logprobs = torch.log_softmax(processed, dim=-1)

        greedy = [t == 0 for t in temps]
        if all(greedy):
            tokens = processed.argmax(dim=-1)
        else:
            # Exponential race (Gumbel-max): argmax p_i / E_i with E_i ~ Exp(1) samples from p.
            noise = torch.empty_like(logprobs).exponential_()
            for row, gen in enumerate(batch.generators):
                if gen is not None:
                    noise[row].exponential_(generator=gen)
            tokens = (logprobs.exp() / noise.clamp_min_(1e-10)).argmax(dim=-1)
            if any(greedy):
                tokens = torch.where(torch.tensor(greedy, device=device), processed.argmax(dim=-1), tokens)
        token_logprobs = logprobs.gather(1, tokens[:, None])[:, 0]

        ranks = None
        top = None
        wanted = [k for k in batch.num_top_logprobs if k is not None]
        if wanted:
            rank_tensor = (logprobs > token_logprobs[:, None]).sum(dim=-1) + 1
            ranks = rank_tensor.tolist()
            k = max(wanted)
            if k > 0:
                values, ids = logprobs.topk(k, dim=-1)
                values = values.tolist()
                ids = ids.tolist()
                top = [
                    list(zip(ids[r], values[r], strict=True))[: batch.num_top_logprobs[r] or 0]
                    for r in range(rows)
                ]
        return SamplerOutput(tokens.tolist(), token_logprobs.tolist(), ranks, top)
