"""Batched sampling and the log-probs it reports.

Log-probs are "processed" (vLLM's ``--logprobs-mode processed_logprobs``): the log-softmax of
the logits after temperature scaling and top-k / top-p masking, i.e. of the distribution the
token was actually drawn from, which is what the trainer recomputes (logits / T). Greedy rows
(temperature 0) use temperature 1. ``process_logits`` is the single definition of that
transform; the trainer side can call it to reproduce the engine's numbers exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from refractor.inference.engine.checked_kernel import CheckedKernel
from refractor.inference.engine.transfer import to_device

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def step_seeds(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One 63-bit Philox key per row from its sequence seed and output position (SplitMix64)."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64) * _GOLDEN + positions.astype(np.uint64) + np.uint64(1)
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(1)).astype(np.int64)


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
    # per-row Philox keys of the fused CUDA sampler (``step_seeds``); None: torch path only
    seeds: np.ndarray | None = None

    def rows(self, index: list[int]) -> SamplingBatch:
        return SamplingBatch(
            [self.temperatures[i] for i in index],
            [self.top_ps[i] for i in index],
            [self.top_ks[i] for i in index],
            [self.generators[i] for i in index],
            [self.num_top_logprobs[i] for i in index],
            None if self.seeds is None else self.seeds[index],
        )

    def plain_rows(self) -> list[int]:
        """Rows the fused sampler takes: no top-k, no top-p, no alternatives (a rank is fine)."""
        return [
            i
            for i, (k, p, n) in enumerate(zip(self.top_ks, self.top_ps, self.num_top_logprobs, strict=True))
            if k <= 0 and p >= 1 and not n
        ]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int] | None
    top_logprobs: list[list[tuple[int, float]]] | None


@dataclass
class DeviceSample:
    """A step's samples where the sampler left them (the device): the engine may feed
    ``token_ids`` to the next step before reading them. ``copy_to_host`` queues the copies back;
    ``result`` waits for those copies only (not for work queued after them)."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32
    ranks: torch.Tensor | None  # [B]; None when no row asked for log-probs
    top_logprobs: list[list[tuple[int, float]]] | None  # already on the host (computing them waits)
    _host: list[torch.Tensor | None] | None = None
    _copied: torch.cuda.Event | None = None

    def copy_to_host(self) -> DeviceSample:
        tensors = [self.token_ids, self.logprobs, self.ranks]
        if not self.token_ids.is_cuda:
            self._host = tensors
            return self
        self._host = [
            None
            if t is None
            else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for t in tensors
        ]
        self._copied = torch.cuda.Event()
        self._copied.record()
        return self

    def result(self) -> SamplerOutput:
        if self._host is None:
            self.copy_to_host()
        if self._copied is not None:
            self._copied.synchronize()
        tokens, logprobs, ranks = self._host
        return SamplerOutput(
            tokens.tolist(), logprobs.tolist(), None if ranks is None else ranks.tolist(), self.top_logprobs
        )


def _load_fused_sampler(device: torch.device, vocab: int):
    from refractor.inference.engine.triton_sampler import sample_triton

    gen = torch.Generator(device=device).manual_seed(0)
    # every compiled variant (see split_count) is built and checked now, not mid-serving
    for rows in (1, 64, 256, 257):
        logits = (torch.randn(rows, vocab, device=device, generator=gen) * 4).to(torch.bfloat16)
        temps = torch.tensor([0.0, 1.0, 0.7, 1.3], device=device).repeat(rows)[:rows]
        seeds = torch.arange(rows, device=device) * 7919
        tokens, logprobs, ranks = sample_triton(logits, temps, seeds, True)
        processed = process_logits(logits, temps)
        want = processed.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
        if not torch.equal(tokens[temps == 0], processed[temps == 0].argmax(-1)):
            raise RuntimeError("its greedy rows differ from argmax")
        error = (logprobs - want).abs().max().item()
        if error > 1e-4:
            raise RuntimeError(f"its log-probs differ from the torch path by {error}")
        scaled = logits.float() * (1.0 / torch.where(temps == 0, 1.0, temps))[:, None]
        if not torch.equal(ranks.long(), (scaled > scaled.gather(1, tokens[:, None])).sum(-1) + 1):
            raise RuntimeError("its ranks differ from counting")
    return sample_triton


_fused_sample: CheckedKernel | None = None


def fused_sampler_available(device: torch.device, vocab: int = 50_000) -> bool:
    """Whether the fused Triton sampler runs on this device: checked against the torch path once,
    with the model's vocabulary size (Triton compiles a variant per size class of its integer
    arguments)."""
    global _fused_sample
    if _fused_sample is None:
        _fused_sample = CheckedKernel(
            "the fused Triton sampler", "torch ops", lambda device: _load_fused_sampler(device, vocab)
        )
    return _fused_sample.available(device)


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.launch(logits, batch).result()

    def launch(self, logits: torch.Tensor, batch: SamplingBatch) -> DeviceSample:
        """Sample without waiting for the device (unless a row asks for top log-probs). Rows the
        fused kernel can take go through it (on CUDA); the others through torch ops."""
        if batch.seeds is None or not fused_sampler_available(logits.device):
            return self._sample_torch(logits, batch)
        plain = batch.plain_rows()
        if len(plain) == logits.shape[0]:
            return self._sample_fused(logits, batch)
        if not plain:
            return self._sample_torch(logits, batch)
        fused = set(plain)
        rest = [i for i in range(logits.shape[0]) if i not in fused]
        device = logits.device
        rows = logits.shape[0]
        tokens = torch.empty(rows, dtype=torch.int64, device=device)
        logprobs = torch.empty(rows, dtype=torch.float32, device=device)
        has_ranks = any(n is not None for n in batch.num_top_logprobs)
        ranks = torch.zeros(rows, dtype=torch.int64, device=device) if has_ranks else None
        top: list = [[] for _ in range(rows)]
        for index, part in (
            (plain, self._sample_fused(logits[plain], batch.rows(plain))),
            (rest, self._sample_torch(logits[rest], batch.rows(rest))),
        ):
            where = to_device(index, device)
            tokens[where] = part.token_ids
            logprobs[where] = part.logprobs
            if ranks is not None and part.ranks is not None:
                ranks[where] = part.ranks.long()
            if part.top_logprobs is not None:
                for j, i in enumerate(index):
                    top[i] = part.top_logprobs[j]
        return DeviceSample(tokens, logprobs, ranks, top if has_ranks else None)

    def _sample_fused(self, logits: torch.Tensor, batch: SamplingBatch) -> DeviceSample:
        device = logits.device
        temps = to_device(torch.tensor(batch.temperatures, dtype=torch.float32), device)
        seeds = to_device(batch.seeds, device)
        wants_ranks = any(n is not None for n in batch.num_top_logprobs)
        tokens, logprobs, ranks = _fused_sample(logits, temps, seeds, wants_ranks)
        return DeviceSample(tokens, logprobs, ranks if wants_ranks else None, None)

    def _sample_torch(self, logits: torch.Tensor, batch: SamplingBatch) -> DeviceSample:
        device = logits.device
        rows = logits.shape[0]
        temps = batch.temperatures
        temperature = temps[0] if len(set(temps)) == 1 else to_device(temps, device)
        top_k = to_device(batch.top_ks, device) if any(k > 0 for k in batch.top_ks) else None
        top_p = to_device(batch.top_ps, device) if any(p < 1 for p in batch.top_ps) else None
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
                tokens = torch.where(to_device(greedy, device), processed.argmax(dim=-1), tokens)
        token_logprobs = logprobs.gather(1, tokens[:, None])[:, 0]

        ranks = None
        top = None
        wanted = [k for k in batch.num_top_logprobs if k is not None]
        if wanted:
            ranks = (logprobs > token_logprobs[:, None]).sum(dim=-1) + 1
            k = max(wanted)
            if k > 0:
                values, ids = logprobs.topk(k, dim=-1)
                values = values.tolist()
                ids = ids.tolist()
                top = [
                    list(zip(ids[r], values[r], strict=True))[: batch.num_top_logprobs[r] or 0]
                    for r in range(rows)
                ]
        return DeviceSample(tokens, token_logprobs, ranks, top)
