"""Continuous batching: which sequences run in the next step.

Each step is either a prefill (waiting sequences join, whole prompts, up to a token budget) or a
decode (one token for every running sequence). Waiting sequences are ordered by (priority,
arrival) — lower priority value first, as in vLLM's priority policy — and join as soon as a
slot and KV blocks are free, so new requests enter while others decode and finished ones leave
at once. When the KV cache runs out mid-decode, the lowest-priority running sequence is
preempted: its blocks are freed and it is recomputed later (prompt + tokens generated so far).
"""

from __future__ import annotations

import heapq
import time

from refractor.inference.engine.block_manager import BlockManager
from refractor.inference.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, prefill_token_budget: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.prefill_token_budget = prefill_token_budget
        self.waiting: list[tuple[tuple[int, int], int, Sequence]] = []  # heap
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self.waiting, (seq.sort_key(), seq.seq_id, seq))

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences, is_prefill). Prefill first, so waiting requests start as soon as they fit."""
        batch: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0][2]
            if batch and tokens + seq.num_tokens > self.prefill_token_budget:
                break
            if not self.block_manager.can_grow(seq):
                break
            heapq.heappop(self.waiting)
            self.block_manager.grow(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_time is None:  # a preempted sequence keeps its first start
                seq.scheduled_time = time.monotonic()
            batch.append(seq)
            tokens += seq.num_tokens
        if batch:
            self.running.extend(batch)
            return batch, True
        return self._schedule_decode(), False

    def _schedule_decode(self) -> list[Sequence]:
        # Each decode step writes the KV of every sequence's last token, so each may need a block.
        bm = self.block_manager
        if sum(bm.blocks_needed(s) for s in self.running) <= bm.num_free_blocks:  # the common case
            for seq in self.running:
                bm.grow(seq)
            return list(self.running)
        pending = sorted(self.running, key=Sequence.sort_key)
        scheduled: list[Sequence] = []
        while pending:
            seq = pending.pop(0)
            while not self.block_manager.can_grow(seq) and pending:
                self._preempt(pending.pop())  # the lowest-priority sequence not yet scheduled
            if self.block_manager.can_grow(seq):
                self.block_manager.grow(seq)
                scheduled.append(seq)
            else:
                self._preempt(seq)
        self.running = scheduled
        return list(scheduled)  # a copy: finishing sequences are removed from ``running`` mid-step

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.num_preemptions += 1
        self.add(seq)

    def preempt_all(self) -> None:
        """Drop every running sequence's KV (it is recomputed on its next prefill), e.g. after new weights."""
        for seq in self.running:
            self._preempt(seq)
        self.running = []

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif any(entry[2] is seq for entry in self.waiting):
            self.waiting = [entry for entry in self.waiting if entry[2] is not seq]
            heapq.heapify(self.waiting)
        self.block_manager.free(seq)
