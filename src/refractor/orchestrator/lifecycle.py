"""The lifecycle of every rollout as timeline spans, and what is in flight right now.

Each model call (``generation``), environment response (``env_response``), tool call
(``tool_execution``) and reward computation (``reward``) of a rollout becomes one span of
component ``rollout`` in the run store, written when it ends, with ``rollout_id``, ``group_id``,
``sample``, ``turn``, ``server`` and ``lane`` (docs/metrics.md#rollout-lifecycle-spans). A span that
ends by cancellation or by an exception is still written, with ``outcome`` ``cancelled`` or
``error``. The orchestrator's weight pushes are open spans too (``weight_sync``), so the in-flight
snapshot shows them.

Spans that have started and not ended are the in-flight snapshot: :class:`InflightSnapshots`
writes it to the run store's meta ``inflight`` every interval, for readers in other processes
(the dashboard's "what is running now").

A ``generation`` span names its request (``request_id``, the server's id). When the server's answer
held no latency and the run has a :class:`~refractor.orchestrator.protocols.LatencySource` (vLLM's
trace spans), the span is written once that source has the request's latency, or after
``LATENCY_WAIT_S`` without it: telemetry never holds up the rollout, and a missing account is
simply no latency.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from refractor.orchestrator.protocols import LatencySource
from refractor.records import TimelineEvent

COMPONENT = "rollout"
MAX_INFLIGHT_LISTED = 2000  # a snapshot lists at most this many spans (the oldest), and counts the rest
LATENCY_WAIT_S = 0.5  # vLLM exports its spans every 200 ms: one batch late, and then some


@dataclass
class _Open:
    name: str
    start: float
    attrs: dict[str, Any]


class RolloutEvents:
    """Open and close lifecycle spans; ``record`` stores a finished one (the run store's
    ``log_event``); ``latency`` completes the spans of requests whose server answered without one.
    Used from the event loop only."""

    def __init__(
        self,
        record: Callable[[TimelineEvent], None],
        clock: Callable[[], float],
        latency: LatencySource | None = None,
    ) -> None:
        self.record = record
        self.clock = clock
        self.latency = latency
        self._open: dict[int, _Open] = {}
        self._keys = itertools.count()
        self._completing: set[asyncio.Task] = set()

    @contextmanager
    def span(
        self, name: str, component: str = COMPONENT, *, record: bool = True, **attrs: Any
    ) -> Iterator[dict[str, Any]]:
        """A span around the ``with`` body; the body may add attributes to the dict it gets.
        ``record=False``: in flight only (its event is stored by whoever measures it better)."""
        key = next(self._keys)
        opened = _Open(name, self.clock(), attrs)
        self._open[key] = opened
        outcome = None
        try:
            yield attrs
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except BaseException:
            outcome = "error"
            raise
        finally:
            del self._open[key]
            if outcome is not None:
                attrs["outcome"] = outcome
            if record:
                self._write(TimelineEvent(name, opened.start, self.clock(), component, attrs), outcome)

    def _write(self, event: TimelineEvent, outcome: str | None) -> None:
        """Now, or once the latency source has the request's latency (a finished request whose
        server's answer had none)."""
        request_id = event.attrs.get("request_id")
        if self.latency is None or outcome is not None or request_id is None or "e2e_latency" in event.attrs:
            self.record(event)
            return
        task = asyncio.ensure_future(self._record_with_latency(event, request_id))
        self._completing.add(task)
        task.add_done_callback(self._completing.discard)

    async def _record_with_latency(self, event: TimelineEvent, request_id: str) -> None:
        latency = None
        try:
            latency = await self.latency.take(request_id, LATENCY_WAIT_S)
        finally:  # cancelled (the run ends) or not, the span is written
            event.attrs.update(latency or {})
            self.record(event)

    async def flush(self) -> None:
        """Wait until the spans still waiting for their latency are written (at most ``LATENCY_WAIT_S``)."""
        await asyncio.gather(*self._completing, return_exceptions=True)

    def add(self, name: str, start: float, end: float, **attrs: Any) -> None:
        """A span measured elsewhere (a tool call timed by its environment)."""
        self.record(TimelineEvent(name, start, end, COMPONENT, attrs))

    def inflight(self, limit: int = MAX_INFLIGHT_LISTED) -> dict[str, Any]:
        """``{"time", "count", "spans": [{"name", "start", ...attrs}]}``, oldest first, at most
        ``limit`` spans listed (``count`` is all of them)."""
        spans = sorted(self._open.values(), key=lambda s: s.start)
        return {
            "time": self.clock(),
            "count": len(spans),
            "spans": [{"name": s.name, "start": s.start, **s.attrs} for s in spans[:limit]],
        }


class InflightSnapshots:
    """Writes ``events.inflight()`` to the run store's meta ``inflight`` every ``interval_s``
    (a telemetry loop of the orchestrator), and once more, empty, when it stops."""

    def __init__(self, events: RolloutEvents, set_meta: Callable[[dict[str, Any]], None], interval_s: float):
        self.events = events
        self.set_meta = set_meta
        self.interval_s = interval_s

    async def run(self) -> None:
        try:
            while True:
                self.set_meta({"inflight": self.events.inflight()})
                await asyncio.sleep(self.interval_s)
        finally:
            self.set_meta({"inflight": {"time": self.events.clock(), "count": 0, "spans": []}})
