"""Paged KV-cache bookkeeping: fixed-size blocks, shared between sequences by prefix.

Prefix caching: a full block is named by a hash chained over every token up to its end
(SHA-256 of the parent block's hash and the block's token ids), so two sequences whose first
``k * block_size`` tokens agree find the same ``k`` blocks. Blocks carry reference counts; a block
whose last holder lets go keeps its KV and its name in an LRU of evictable blocks, and is
reclaimed (name dropped) only when the free list runs dry. Partial blocks are never shared: a
sequence always owns the block it writes to, so no copy-on-write is needed, and a prompt
recomputes at most its tail of fewer than ``block_size`` tokens (at least its last token, whose
logits start the generation).

A block names its KV only once that KV exists: blocks a prefill step is computing are "pending",
and a sequence whose prefix runs into a pending block waits for the next step instead of
recomputing it (``match`` returns None). Any change of weights or loss of the cache
(``reset_prefix_cache``) forgets every name, and blocks computed under the old weights are never
named again.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np

from refractor.inference.engine.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.hash_of: dict[int, bytes] = {}  # named blocks
        self.block_of: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # named, unreferenced; oldest first
        self.pending: set[int] = set()  # named by the prefill step now being computed
        self.epoch = 0  # bumped by every reset: KV computed before it is never named
        self.hit_tokens_total = 0
        self.query_tokens_total = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_of)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---- admission (a waiting sequence gets its blocks for a prefill) ----------------------------
    def match(self, seq: Sequence) -> list[int] | None:
        """The cached blocks of the sequence's prefix (not yet taken), or None when that prefix
        runs into a block the current step is computing (admit it in the next step instead)."""
        if not self.enable_prefix_caching:
            return []
        # at most the blocks before the last token: its logits must be computed
        hashes = self._prefix_hashes(seq)[: (seq.num_tokens - 1) // self.block_size]
        hits = []
        for h in hashes:
            block = self.block_of.get(h)
            if block is None:
                break
            if block in self.pending:
                return None
            hits.append(block)
        return hits

    def admit(self, seq: Sequence, hits: list[int]) -> bool:
        """Give a waiting sequence the blocks of all its tokens, starting with ``hits`` (from
        ``match``); sets ``seq.num_computed_tokens`` to the tokens whose KV they hold. False: no room."""
        bs = self.block_size
        new = -(-seq.num_tokens // bs) - len(hits)
        if new > self.num_free_blocks - sum(1 for b in hits if self.ref_counts[b] == 0):
            return False
        for block in hits:
            self._take(block)
        seq.block_table = hits + [self._allocate() for _ in range(new)]
        seq.table_version += 1
        seq.num_computed_tokens = len(hits) * bs
        seq.kv_epoch = self.epoch
        if self.enable_prefix_caching:
            self.query_tokens_total += seq.num_tokens
            self.hit_tokens_total += seq.num_computed_tokens
            # the full blocks this prefill computes get their names now, pending until it is done
            full = self._prefix_hashes(seq)[: seq.num_tokens // bs]
            for index in range(len(hits), len(full)):
                if self._name(seq.block_table[index], full[index]):
                    self.pending.add(seq.block_table[index])
        return True

    def finish_prefill_step(self) -> None:
        """The step's prefills are done: their named blocks hold their KV now."""
        self.pending.clear()

    def discard_pending(self) -> None:
        """The step failed: the blocks it was computing hold no trustworthy KV."""
        for block in self.pending:
            self._unname(block)
        self.pending.clear()

    # ---- decode growth -----------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_tokens: int | None = None) -> int:
        """Blocks to add so the cache can hold ``num_tokens`` (default: all of the sequence's tokens)."""
        tokens = seq.num_tokens if num_tokens is None else num_tokens
        return max(0, -(-tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Add the blocks ``seq`` needs to hold ``num_tokens`` (default: all of its tokens)."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._allocate())
            seq.table_version += 1

    # ---- release -----------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Let go of the sequence's blocks. Its full blocks of computed KV (every token but the last,
        which was sampled and never fed) are named first, so a later prompt that extends this
        sequence (the next turn of a conversation, a preempted sequence's re-prefill) reuses them."""
        table = seq.block_table
        if not table:
            return
        if self.enable_prefix_caching and seq.kv_epoch == self.epoch:
            computed = (seq.num_tokens - 1) // self.block_size
            for block, h in zip(table[:computed], self._prefix_hashes(seq)[:computed], strict=False):
                if block not in self.pending:
                    self._name(block, h)
        for block in table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] > 0:
                continue
            if block in self.pending:  # its prefill never finished (the request failed in the step)
                self._unname(block)
                self.pending.discard(block)
            if block in self.hash_of:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)
        seq.block_table = []
        seq.table_version += 1
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every name (new weights, or the KV cache was given back): cached blocks are free
        again, and blocks still held are freed unnamed."""
        self.epoch += 1
        self.pending.clear()
        self.free_blocks.extend(self.evictable)
        self.evictable.clear()
        self.hash_of.clear()
        self.block_of.clear()

    # ---- internals ---------------------------------------------------------------------------
    def _prefix_hashes(self, seq: Sequence) -> list[bytes]:
        """The chained hashes of the sequence's full blocks (extended as it grows)."""
        hashes = seq.block_hashes
        bs = self.block_size
        tokens = seq.token_ids
        for index in range(len(hashes), len(tokens) // bs):
            parent = hashes[-1] if hashes else b""
            hashes.append(block_hash(parent, tokens[index * bs : (index + 1) * bs]))
        return hashes

    def _name(self, block: int, h: bytes) -> bool:
        """Name ``block`` by ``h`` unless it or another block already has a name (the first keeps it)."""
        if block in self.hash_of or h in self.block_of:
            return False
        self.hash_of[block] = h
        self.block_of[h] = block
        return True

    def _unname(self, block: int) -> None:
        h = self.hash_of.pop(block, None)
        if h is not None and self.block_of.get(h) == block:
            del self.block_of[h]

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1

    def _allocate(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:  # reclaim the least recently released cached block
            block, _ = self.evictable.popitem(last=False)
            self._unname(block)
        self.ref_counts[block] = 1
        return block
