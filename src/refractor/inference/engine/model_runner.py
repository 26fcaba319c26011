"""Runs the shared decoder for one engine step: owns the KV cache and the decode CUDA graphs."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from refractor.inference.engine.attention import (
    SPLIT_KV_MIN_CONTEXT,
    CachedPrefixAttention,
    DecodeAttention,
    PrefillAttention,
    split_count,
    triton_decode_available,
    varlen_prefill_available,
)
from refractor.inference.engine.config import EngineConfig
from refractor.inference.engine.sequence import Sequence
from refractor.inference.engine.sleep import ReleasableBuffer
from refractor.inference.engine.transfer import to_device
from refractor.models import CausalLM
from refractor.models.ops import enable_compiled_ops

log = logging.getLogger(__name__)
GiB = 1 << 30
DEFAULT_CPU_KV_GB = 1.0


def decode_graph_sizes(max_bs: int) -> list[int]:
    """The padded batch sizes that get a decode CUDA graph: 1, 2, 4, 8, then every 16 up to 256,
    every 32 up to 512 and every 64 beyond (always ``max_bs`` itself). A batch runs the smallest
    graph that holds it, so padding stays within 1/8 of a large batch while a server running a
    couple of thousand sequences captures ~50 graphs instead of ~130 (each capture is start-up
    time)."""
    steps = [*range(16, 257, 16), *range(288, 513, 32), *range(576, max_bs + 64, 64)]
    return sorted({s for s in [1, 2, 4, 8, *steps] if s <= max_bs} | {max_bs})


class ModelRunner:
    def __init__(self, model: CausalLM, config: EngineConfig, device: torch.device):
        self.model = model
        self.config = config
        self.device = device
        mc = model.config
        self.dtype = next(model.parameters()).dtype
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        self.block_bytes = (
            2
            * mc.num_hidden_layers
            * config.block_size
            * mc.num_key_value_heads
            * mc.head_dim
            * self.dtype.itemsize
        )
        self.compiled_ops = (
            device.type == "cuda"
            and config.compile_ops
            and not config.enforce_eager
            and enable_compiled_ops(device)
        )
        started = time.perf_counter()
        self.num_blocks = self._plan_num_blocks()
        # seconds of each start-up phase, for the server's first lines
        self.startup_s = {"kv_plan": time.perf_counter() - started}
        # One extra block at the end absorbs the writes of padded CUDA-graph rows.
        self.pad_block = self.num_blocks
        shape = (
            2,
            mc.num_hidden_layers,
            self.num_blocks + 1,
            config.block_size,
            mc.num_key_value_heads,
            mc.head_dim,
        )
        # sleep mode: the cache lives in memory that a sleep gives back at a fixed address
        self.kv_memory = None
        if config.enable_sleep_mode:
            self.kv_memory = ReleasableBuffer((self.num_blocks + 1) * self.block_bytes, device)
            self.kv_cache = self.kv_memory.view(0, self.dtype, shape)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=device)
        self.use_triton = triton_decode_available(device)
        self.varlen_prefill = varlen_prefill_available(device, self.dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # the same steps with split-KV attention, for batch sizes too small to fill the GPU
        self.split_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if device.type == "cuda" and not config.enforce_eager and not model.model.rotary.dynamic:
            started = time.perf_counter()
            self._capture_decode_graphs()
            self.startup_s["cuda_graphs"] = time.perf_counter() - started

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    # ---- KV-cache sizing -------------------------------------------------------------------
    def _plan_num_blocks(self) -> int:
        cfg = self.config
        if cfg.kv_cache_memory_gb is not None:
            budget = cfg.kv_cache_memory_gb * GiB
        elif self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:
            budget = DEFAULT_CPU_KV_GB * GiB
            log.info(
                "no kv_cache_memory_gb on %s: using %.1f GiB for the KV cache", self.device, DEFAULT_CPU_KV_GB
            )
        num_blocks = int(budget // self.block_bytes)
        if num_blocks * self.block_size < cfg.max_model_len:
            raise ValueError(
                f"the KV-cache budget ({budget / GiB:.3f} GiB) holds {num_blocks * self.block_size} "
                f"tokens, fewer than max_model_len={cfg.max_model_len}; "
                "raise kv_cache_memory_gb / gpu_memory_utilization "
                "or lower max_model_len"
            )
        return num_blocks

    @torch.inference_mode()
    def _profile_cuda_budget(self) -> float:
        """Memory left for the KV cache after weights and the largest step's activations."""
        cfg = self.config
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        seq_len = cfg.max_model_len
        num_seqs = max(1, min(cfg.prefill_token_budget // seq_len, cfg.max_num_seqs))
        ids = torch.zeros(num_seqs * seq_len, dtype=torch.long, device=self.device)
        positions = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        attention = PrefillAttention(None, ids, ids, ids, num_seqs, seq_len)
        hidden = self.model(ids, positions, attention)
        del hidden
        logits = self.model.compute_logits(
            torch.zeros(cfg.max_num_seqs, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
        )
        torch.log_softmax(logits.float(), dim=-1).exp()
        del logits
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # so mem_get_info counts what is held, not what the allocator cached
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        peak = stats["allocated_bytes.all.peak"]
        current = stats["allocated_bytes.all.current"]
        return total * cfg.gpu_memory_utilization - (total - free) - (peak - current)

    # ---- steps -----------------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self, seqs: list[Sequence], is_prefill: bool, next_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [len(seqs), V] for the next token of each sequence.

        ``next_ids`` (decode only): each sequence's next token, sampled by the step before and not
        yet appended on the host; the step then runs one position past the host's tokens.
        """
        if is_prefill:
            return self._run_prefill(seqs)
        size = next((s for s in self.graphs if s >= len(seqs)), None)
        if size is not None:
            return self._run_decode_graph(seqs, size, next_ids)
        return self._run_decode_eager(seqs, next_ids)

    def _run_prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Each sequence's tokens after its cached prefix (all of them without one)."""
        starts = [s.num_computed_tokens for s in seqs]
        ends = [s.num_tokens for s in seqs]
        lens = [e - b for b, e in zip(starts, ends, strict=True)]
        ids = torch.tensor([t for s, b in zip(seqs, starts, strict=True) for t in s.token_ids[b:]])
        positions = torch.cat([torch.arange(b, e) for b, e in zip(starts, ends, strict=True)])
        # the slot of every position of every sequence, from the padded block rows the decode uses
        width = -(-max(ends) // self.block_size)
        rows = torch.from_numpy(np.stack([self._block_row(s)[:width] for s in seqs])).long()
        context = (rows[:, :, None] * self.block_size + torch.arange(self.block_size)).flatten(1)
        slots = torch.cat([context[i, b:e] for i, (b, e) in enumerate(zip(starts, ends, strict=True))])
        ends_in_step = torch.tensor(lens).cumsum(0)
        last = ends_in_step - 1
        to = self._to_device
        positions = to(positions)
        if any(starts):
            attention = CachedPrefixAttention.build(
                self.kv_cache, to(slots), starts, ends, context[:, : max(ends)], self.device
            )
        else:
            batch_index = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lens))
            cu_seqlens = None
            if self.varlen_prefill:
                cu_seqlens = to(torch.tensor([0, *ends_in_step.tolist()], dtype=torch.int32))
            attention = PrefillAttention(
                self.kv_cache, to(slots), to(batch_index), positions, len(seqs), max(lens), cu_seqlens
            )
        hidden = self.model(to(ids), positions, attention)
        return self.model.compute_logits(hidden[to(last)])

    def _decode_inputs(
        self, seqs: list[Sequence], rows: int, width: int, ahead: bool = False
    ) -> tuple[np.ndarray, ...]:
        """Host arrays for ``rows`` rows; rows past len(seqs) point at the padding block. ``ahead``:
        each sequence has one more token than the host holds (its id comes from the device)."""
        bs = self.block_size
        count = len(seqs)
        ids = np.zeros(rows, dtype=np.int64)
        positions = np.zeros(rows, dtype=np.int64)
        slots = np.full(rows, self.pad_block * bs, dtype=np.int64)
        context = np.ones(rows, dtype=np.int32)
        tables = np.full((rows, width), self.pad_block, dtype=np.int32)
        n = np.fromiter((s.num_tokens for s in seqs), np.int64, count) + int(ahead)
        if not ahead:
            ids[:count] = np.fromiter((s.token_ids[-1] for s in seqs), np.int64, count)
        positions[:count] = n - 1
        context[:count] = n
        table = np.stack([self._block_row(s) for s in seqs])
        slots[:count] = table[np.arange(count), (n - 1) // bs].astype(np.int64) * bs + (n - 1) % bs
        tables[:count] = table[:, :width]
        return ids, positions, slots, context, tables

    def _block_row(self, seq: Sequence) -> np.ndarray:
        """The sequence's block table padded to ``max_blocks_per_seq``, rebuilt only when it changed."""
        if seq.block_row_version != seq.table_version:
            row = np.full(self.max_blocks_per_seq, self.pad_block, dtype=np.int32)
            row[: len(seq.block_table)] = seq.block_table
            seq.block_row = row
            seq.block_row_version = seq.table_version
        return seq.block_row

    def _to_device(self, x: torch.Tensor | np.ndarray) -> torch.Tensor:
        return to_device(x, self.device)

    def _run_decode_eager(self, seqs: list[Sequence], next_ids: torch.Tensor | None) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        ids, positions, slots, context, tables = map(
            self._to_device, self._decode_inputs(seqs, len(seqs), width, next_ids is not None)
        )
        if next_ids is not None:
            ids = next_ids
        splits = self._splits(len(seqs), max(s.num_tokens for s in seqs) + int(next_ids is not None))
        attention = DecodeAttention(self.kv_cache, slots, context, tables, self.use_triton, splits)
        return self.model.compute_logits(self.model(ids, positions, attention))

    def _splits(self, batch: int, max_context: int) -> int:
        """Context shares per attention program for a decode step of ``batch`` sequences."""
        if not self.use_triton or max_context < SPLIT_KV_MIN_CONTEXT:
            return 1
        return split_count(batch, self.model.config.num_key_value_heads, self.device)

    # ---- CUDA graphs -----------------------------------------------------------------------
    def _capture_decode_graphs(self) -> None:
        """One graph per padded batch size (two where split-KV applies); each replays embed ->
        layers -> final norm for decode."""
        max_bs = self.config.max_num_seqs
        sizes = decode_graph_sizes(max_bs)
        dev = self.device
        hidden_size = self.model.config.hidden_size
        self.static = {
            "ids": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "slots": torch.full((max_bs,), self.pad_block * self.block_size, dtype=torch.long, device=dev),
            "context": torch.ones(max_bs, dtype=torch.int32, device=dev),
            "tables": torch.full(
                (max_bs, self.max_blocks_per_seq), self.pad_block, dtype=torch.int32, device=dev
            ),
        }
        self.static_hidden = torch.zeros(max_bs, hidden_size, dtype=self.dtype, device=dev)
        s = self.static
        pool = None
        for size in reversed(sizes):
            splits = self._splits(size, SPLIT_KV_MIN_CONTEXT)
            kinds = [(self.graphs, 1)] + ([(self.split_graphs, splits)] if splits > 1 else [])
            for graphs, shares in kinds:
                attention = DecodeAttention(
                    self.kv_cache,
                    s["slots"][:size],
                    s["context"][:size],
                    s["tables"][:size],
                    self.use_triton,
                    shares,
                )

                def step(size=size, attention=attention):
                    self.static_hidden[:size] = self.model(s["ids"][:size], s["positions"][:size], attention)

                step()  # warm-up: kernels selected / compiled outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    step()
                pool = graph.pool() if pool is None else pool
                graphs[size] = graph
        self.graphs = dict(sorted(self.graphs.items()))
        torch.cuda.synchronize(dev)

    def _run_decode_graph(
        self, seqs: list[Sequence], size: int, next_ids: torch.Tensor | None
    ) -> torch.Tensor:
        arrays = self._decode_inputs(seqs, size, self.max_blocks_per_seq, next_ids is not None)
        for key, array in zip(("ids", "positions", "slots", "context", "tables"), arrays, strict=True):
            self.static[key][:size].copy_(self._to_device(array))
        if next_ids is not None:  # after the host's zeros, in stream order
            self.static["ids"][: len(seqs)].copy_(next_ids)
        split = size in self.split_graphs and int(arrays[3].max()) >= SPLIT_KV_MIN_CONTEXT
        (self.split_graphs if split else self.graphs)[size].replay()
        return self.model.compute_logits(self.static_hidden[: len(seqs)])
