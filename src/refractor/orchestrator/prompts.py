"""A seeded, checkpointable, weighted multi-environment prompt stream, and its prefetch buffer.

The stream is infinite. Each draw picks an environment with probability proportional to its
weight (one seeded generator), then the next index of that environment's current epoch; every
epoch is a fresh seeded permutation of the dataset, so within an epoch no prompt repeats.

Every fresh draw gets an *ordinal* (0, 1, 2, ...: its position in the stream). A prompt keeps
its ordinal when it is replayed, so what is derived from it (the sampling seeds and the batch
order of ``deterministic_rollouts``) is the same whether or not the prompt was interrupted.

Resume: ``state_dict()`` holds the generator state, the per-environment cursors and a *replay*
list of prompts that were drawn but never trained on (prefetched, or in flight at checkpoint
time). A stream restored from it serves the replay list first (in stream order), then continues
exactly where the saved stream would have. So an uninterrupted run and a save/restore run see the
same prompts, with the same ordinals.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import numpy as np

from refractor.records import PromptRef

P = TypeVar("P")


class PromptStream:
    def __init__(
        self, dataset_sizes: dict[str, int], weights: dict[str, float] | None = None, seed: int = 0
    ) -> None:
        if not dataset_sizes:
            raise ValueError("the prompt stream needs at least one environment")
        empty = [name for name, n in dataset_sizes.items() if n <= 0]
        if empty:
            raise ValueError(f"environment(s) {empty} have an empty dataset; check their dataset path/split")
        weights = weights or {}
        unknown = set(weights) - set(dataset_sizes)
        if unknown:
            raise ValueError(f"weights given for unknown environment(s) {sorted(unknown)}")
        self.names = list(dataset_sizes)
        self.sizes = dict(dataset_sizes)
        w = np.array([float(weights.get(n, 1.0)) for n in self.names], dtype=np.float64)
        if (w <= 0).any():
            raise ValueError(
                f"environment weights must be > 0, got {dict(zip(self.names, w.tolist(), strict=True))}"
            )
        self.probs = w / w.sum()
        self.seed = seed
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._cursors = dict.fromkeys(self.names, 0)
        self._perms: dict[str, tuple[int, np.ndarray]] = {}
        self.replay: deque[PromptRef] = deque()
        self.drawn = 0  # next() calls, replays included
        self.next_ordinal = 0  # fresh draws so far

    def next(self) -> PromptRef:
        self.drawn += 1
        if self.replay:
            return self.replay.popleft()
        ordinal = self.next_ordinal
        self.next_ordinal += 1
        if len(self.names) == 1:
            name = self.names[0]
        else:
            name = self.names[int(self._rng.choice(len(self.names), p=self.probs))]
        cursor = self._cursors[name]
        self._cursors[name] = cursor + 1
        epoch, pos = divmod(cursor, self.sizes[name])
        return PromptRef(name, int(self._epoch_permutation(name, epoch)[pos]), ordinal)

    def _epoch_permutation(self, name: str, epoch: int) -> np.ndarray:
        cached = self._perms.get(name)
        if cached is None or cached[0] != epoch:
            env_idx = self.names.index(name)
            perm = np.random.Generator(np.random.PCG64([self.seed, env_idx, epoch])).permutation(
                self.sizes[name]
            )
            cached = (epoch, perm)
            self._perms[name] = cached
        return cached[1]

    def state_dict(self, unconsumed: list[PromptRef] | tuple[PromptRef, ...] = ()) -> dict[str, Any]:
        """Serializable state; ``unconsumed`` prompts (drawn, never trained) are replayed first on resume."""
        return {
            "seed": self.seed,
            "sizes": dict(self.sizes),
            "rng": self._rng.bit_generator.state,
            "cursors": dict(self._cursors),
            "replay": [[r.env_name, r.index, r.ordinal] for r in (*unconsumed, *self.replay)],
            "drawn": self.drawn,
            "next_ordinal": self.next_ordinal,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["sizes"] != self.sizes:
            raise ValueError(
                f"prompt stream state was saved for dataset sizes {state['sizes']}, "
                f"but the environments now have {self.sizes}; resuming would replay other prompts"
            )
        self.seed = int(state["seed"])
        self._rng.bit_generator.state = state["rng"]
        self._cursors = {k: int(v) for k, v in state["cursors"].items()}
        self._perms.clear()
        self.drawn = int(state["drawn"])
        self.next_ordinal = int(state.get("next_ordinal", self.drawn))
        replay = []
        for entry in state["replay"]:
            ordinal = int(entry[2]) if len(entry) > 2 and int(entry[2]) >= 0 else self._fresh_ordinal()
            replay.append(PromptRef(entry[0], int(entry[1]), ordinal))
        self.replay = deque(sorted(replay, key=lambda r: r.ordinal))  # stream order, however it was saved

    def _fresh_ordinal(self) -> int:  # for replay entries saved without one (older checkpoints)
        self.next_ordinal += 1
        return self.next_ordinal - 1

    def lowest_unconsumed_ordinal(self) -> int:
        """The smallest ordinal not handed out yet: the next replayed prompt's, else the next fresh one."""
        return min([r.ordinal for r in self.replay] + [self.next_ordinal])


class PromptPrefetcher(Generic[P]):
    """Keeps up to ``buffer_size`` prompts prepared ahead of dispatch (rendering/tokenizing off the loop).

    ``prepare`` turns a ref into a ready prompt; it runs in a worker thread. With ``buffer_size == 0``
    prompts are prepared on demand. Order is always the stream's order.
    """

    def __init__(
        self,
        stream: PromptStream,
        prepare: Callable[[PromptRef], P],
        buffer_size: int,
        run_blocking: Callable[[Callable[[], P]], Awaitable[P]] | None = None,
    ) -> None:
        self.stream = stream
        self.prepare = prepare
        self.buffer_size = max(0, buffer_size)
        self._run_blocking = run_blocking or (lambda fn: asyncio.to_thread(fn))
        self._buffer: deque[tuple[PromptRef, asyncio.Future[P]]] = deque()

    def __len__(self) -> int:
        return len(self._buffer)

    def refill(self) -> None:
        """Start preparing prompts until the buffer is full (call from the event loop)."""
        while len(self._buffer) < self.buffer_size:
            self._buffer.append(self._start(self.stream.next()))

    def ready(self) -> bool:
        """True when the next prompt can be taken without waiting on its preparation."""
        return bool(self._buffer) and self._buffer[0][1].done()

    async def take(self) -> tuple[PromptRef, P]:
        """The next prompt in order. It stays in the buffer (so a checkpoint taken meanwhile still holds
        it) until its preparation is done; if ``put_back`` slipped earlier prompts in front of it in
        the meantime, the new head is taken instead."""
        while True:
            if not self._buffer:
                self._buffer.append(self._start(self.stream.next()))
            ref, task = self._buffer[0]
            await asyncio.wait([task])  # not `await task`: cancelling take() must not cancel the preparation
            if self._buffer and self._buffer[0] == (ref, task):
                self._buffer.popleft()
                self.refill()
                return ref, task.result()

    def _start(self, ref: PromptRef) -> tuple[PromptRef, asyncio.Future[P]]:
        return ref, asyncio.ensure_future(self._run_blocking(lambda: self.prepare(ref)))

    def buffered_refs(self) -> list[PromptRef]:
        return [ref for ref, _ in self._buffer]

    def put_back(self, refs: list[PromptRef]) -> None:
        """Return taken prompts (their groups will run again): they are served next, in stream order."""
        returned = [self._start(ref) for ref in refs]
        self._buffer = deque(sorted([*returned, *self._buffer], key=lambda item: item[0].ordinal))

    def lowest_unconsumed_ordinal(self) -> int:
        return min([ref.ordinal for ref, _ in self._buffer] + [self.stream.lowest_unconsumed_ordinal()])

    def state_dict(self, in_flight: list[PromptRef] | tuple[PromptRef, ...] = ()) -> dict[str, Any]:
        """Stream state with in-flight and prefetched prompts queued for replay (none is lost)."""
        return self.stream.state_dict(unconsumed=[*in_flight, *self.buffered_refs()])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for _, task in self._buffer:
            task.cancel()
        self._buffer.clear()
        self.stream.load_state_dict(state)

    def close(self) -> None:
        for _, task in self._buffer:
            task.cancel()
