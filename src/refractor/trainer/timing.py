"""Spans of one training step: CUDA events on GPU (one synchronize per step), wall clock on CPU.

``with timer.span("forward", microbatch=3): ...`` records a span; ``timer.finish()`` resolves them
into ``TimelineEvent`` records (unix-second start/end), ``timing_<name>_total`` seconds and, for
spans run once per micro-batch, ``timing_<name>_microbatch_{mean,std,min,max}``.
Names nest with ``/`` (a child span is ``parent/child``); the spans and their names are listed in
docs/metrics.md#trainer-spans.

A timer made with ``detail=False`` (``track_gpu_events: false``) keeps only the spans opened with
``always=True`` (the whole ``step``), timed by the wall clock: no CUDA event is recorded, and on GPU
the one synchronize per step happens when such a span ends.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from refractor.records import TimelineEvent


class StepTimer:
    def __init__(
        self,
        device: torch.device,
        component: str = "trainer",
        attrs: dict[str, Any] | None = None,
        *,
        detail: bool = True,
    ):
        self.on_gpu = device.type == "cuda"
        self.cuda = self.on_gpu and detail  # CUDA events only for the detailed spans
        self.detail = detail
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
    def span(self, name: str, *, always: bool = False, **attrs: Any) -> Iterator[None]:
        if not (self.detail or always):
            yield
            return
        start = self._mark()
        try:
            yield
        finally:
            if self.on_gpu and not self.cuda:
                torch.cuda.synchronize()  # a wall-clock span of GPU work ends when the work does
            self._spans.append((name, start, self._mark(), attrs))

    def _offset(self, mark: Any) -> float:
        """Seconds since the timer was created."""
        if self.cuda:
            return self._origin.elapsed_time(mark) / 1000.0
        return mark - self._t0_perf

    def finish(self) -> tuple[list[TimelineEvent], dict[str, float]]:
        """Synchronize once and return (events, the ``timing_*`` seconds of the module docstring)."""
        if self.cuda:
            torch.cuda.synchronize()
        events: list[TimelineEvent] = []
        totals: dict[str, float] = defaultdict(float)
        per_microbatch: dict[str, list[float]] = defaultdict(list)
        for name, start, end, attrs in self._spans:
            s = self._offset(start)
            e = self._offset(end)
            if "microbatch" in attrs:
                per_microbatch[name].append(e - s)
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
        for name, durations in per_microbatch.items():
            key = f"timing_{name.replace('/', '_')}_microbatch"
            totals[f"{key}_mean"] = statistics.fmean(durations)
            totals[f"{key}_std"] = statistics.pstdev(durations)
            totals[f"{key}_min"] = min(durations)
            totals[f"{key}_max"] = max(durations)
        return events, dict(totals)
