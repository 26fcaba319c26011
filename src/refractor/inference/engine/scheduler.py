"""Continuous batching: which sequences run in the next step.

Each step is either a prefill (waiting sequences join, whole prompts less their cached prefix,
up to a token budget) or a decode (one token for every running sequence). Waiting sequences are
ordered by (priority, arrival) — lower priority value first, as in vLLM's priority policy — and
join when a slot and KV blocks are free (see ``schedule`` for how often a full batch takes them),
so new requests enter while others decode and finished ones leave at once. When the KV cache
runs out mid-decode, the lowest-priority running sequence is preempted: its blocks are freed
(its full blocks stay in the prefix cache) and it is recomputed later (prompt + tokens so far).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from refractor.inference.engine.block_manager import BlockManager
from refractor.inference.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        prefill_token_budget: int,
        decode_steps_between_prefills: int = 0,
        max_prefill_delay_s: float = float("inf"),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.prefill_token_budget = prefill_token_budget
        self.decode_steps_between_prefills = decode_steps_between_prefills
        self.max_prefill_delay_s = max_prefill_delay_s
        self._clock = clock
        self._last_prefill = clock()
        self.waiting: list[tuple[tuple[int, int], int, Sequence]] = []  # heap
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._decodes_since_prefill = 0
        self._deferred = False  # the last prefill left sequences waiting for its blocks
        self.waiting_tokens = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self.waiting, (seq.sort_key(), seq.seq_id, seq))
        self.waiting_tokens += seq.num_tokens

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences, is_prefill). While sequences decode, the waiting ones are prefilled once
        ``decode_steps_between_prefills`` decode steps or ``max_prefill_delay_s`` seconds have
        passed since the last prefill, or as soon as they fill the prefill token budget, so
        newcomers are prefilled together rather than one step each (each prefill step stalls every
        decoding sequence). The time bound keeps the wait short when steps are slow (a trainer
        sharing the GPU). With nothing decoding they are prefilled at once."""
        if self.waiting and self._prefill_due():
            batch = self._schedule_prefill()
            if batch:
                self._decodes_since_prefill = 0
                self._last_prefill = self._clock()
                return batch, True
        self._decodes_since_prefill += 1
        return self._schedule_decode(), False

    def schedule_ahead(self, seqs: list[Sequence]) -> bool:
        """Whether ``seqs`` (the running sequences, whose last step has not been recorded yet) can
        decode once more now, one token past what the host holds: True takes the KV blocks that
        needs. False when a prefill is due or the blocks would need a preemption; the engine then
        records the step first and schedules as usual."""
        if (self.waiting and self._prefill_due()) or len(seqs) != len(self.running):
            return False
        bm = self.block_manager
        needing = [s for s in seqs if bm.blocks_needed(s, s.num_tokens + 1)]
        if len(needing) > bm.num_free_blocks:
            return False
        for seq in needing:
            bm.grow(seq, seq.num_tokens + 1)
        self._decodes_since_prefill += 1
        return True

    def _prefill_due(self) -> bool:
        return (
            not self.running
            or self._deferred
            or self._decodes_since_prefill >= self.decode_steps_between_prefills
            or self.waiting_tokens >= self.prefill_token_budget
            or self._clock() - self._last_prefill >= self.max_prefill_delay_s
        )

    def _schedule_prefill(self) -> list[Sequence]:
        bm = self.block_manager
        batch: list[Sequence] = []
        deferred = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0][2]
            hits = bm.match(seq)
            if hits is None:  # its prefix is computed in this very step: take it in the next
                deferred.append(heapq.heappop(self.waiting))
                continue
            new_tokens = seq.num_tokens - len(hits) * bm.block_size
            if batch and tokens + new_tokens > self.prefill_token_budget:
                break
            if not bm.admit(seq, hits):
                break
            heapq.heappop(self.waiting)
            self.waiting_tokens -= seq.num_tokens
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_time is None:  # a preempted sequence keeps its first start
                seq.scheduled_time = time.monotonic()
            batch.append(seq)
            tokens += new_tokens
        for entry in deferred:
            heapq.heappush(self.waiting, entry)
        self._deferred = bool(deferred)
        self.running.extend(batch)
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        # Each decode step writes the KV of every sequence's last token, so each may need a block.
        bm = self.block_manager
        # a running sequence needs at most one block: the one its last token's KV goes to
        needing = [s for s in self.running if s.num_tokens > len(s.block_table) * bm.block_size]
        if len(needing) <= bm.num_free_blocks:  # the common case
            for seq in needing:
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
            self.waiting_tokens -= seq.num_tokens
        self.block_manager.free(seq)
