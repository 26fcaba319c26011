"""Spans of one training step: CUDA events on GPU (one synchronize per step), wall clock on CPU.

``with timer.span("forward", microbatch=3): ...`` records a span; ``timer.finish()`` resolves them
into ``TimelineEvent`` records (unix-second start/end) and ``timing_<name>_total`` seconds.
Names nest with ``/`` (a child span is ``parent/child``); the spans and their names are listed in
docs/metrics.md#trainer-spans.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from refractor.records import TimelineEvent


class StepTimer:
    def __init__(self, device: torch.device, component: str = "trainer", attrs: dict[str, Any] | None = None):
        self.cuda = device.type == "cuda"
        self.component = component
        self.attrs = attrs or {}
        self._spans: list[tuple[str, Any, Any, dict[str, Any]]] = []
        self._t0_wall = time.time()
        self._t0_perf = time.perf_counter()
        if self.cuda:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()

    def _mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    @contextmanager
    def span(self, name: str, **attrs: Any) -> Iterator[None]:
        start = self._mark()
        try:
            yield
        finally:
            self._spans.append((name, start, self._mark(), attrs))

    def _offset(self, mark: Any) -> float:
        """Seconds since the timer was created."""
        if self.cuda:
            return self._origin.elapsed_time(mark) / 1000.0
        return mark - self._t0_perf

    def finish(self) -> tuple[list[TimelineEvent], dict[str, float]]:
        """Synchronize once and return (events, ``timing_<name>_total`` seconds, + microbatch counts)."""
        if self.cuda:
            torch.cuda.synchronize()
        events: list[TimelineEvent] = []
        totals: dict[str, float] = defaultdict(float)
        for name, start, end, attrs in self._spans:
            s = self._offset(start)
            e = self._offset(end)
            events.append(
                TimelineEvent(
                    name=name,
                    start=self._t0_wall + s,
                    end=self._t0_wall + e,
                    component=self.component,
                    attrs={**self.attrs, **attrs},
                )
            )
            totals[f"timing_{name.replace('/', '_')}_total"] += e - s
        return events, dict(totals)
