"""Paged KV-cache bookkeeping: fixed-size blocks handed out from a free list (no prefix sharing)."""

from __future__ import annotations

from collections import deque

from refractor.inference.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int | None = None) -> int:
        """Blocks to add so the cache can hold ``num_tokens`` (default: all of the sequence's tokens)."""
        tokens = seq.num_tokens if num_tokens is None else num_tokens
        return max(0, -(-tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq) <= len(self.free_blocks)

    def grow(self, seq: Sequence) -> None:
        for _ in range(self.blocks_needed(seq)):
            seq.block_table.append(self.free_blocks.popleft())

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []
