"""Typed results of a weight update: its target, the sender's result, and rank 0's report of a sync."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from refractor.records import TimelineEvent
from refractor.weight_sync.data_plane import SendStats, WorkerReport


class UpdateTarget(StrEnum):
    """Which servers an update reaches; each target has its own transfer group."""

    FULL = "full"  # every server
    TRAINING_ONLY = "training_only"  # all but the eval servers, which keep serving an older version
    RESTARTED = "restarted"  # one restarted server, before it serves again (a group made for it)


@dataclass(frozen=True)
class PushResult:
    version: int
    target: UpdateTarget
    trainer_seconds: float  # the trainer's whole sync: gather ahead + pause ... resume + canary
    paused_seconds: float  # the servers' pause -> resume (generation stopped)
    transfer_seconds: float  # data plane only (pack + broadcast of every bucket)
    stats: SendStats
    reports: dict[str, list[WorkerReport]]  # server name -> one report per worker
    gathered_ahead_bytes: int = 0  # bucket bytes materialized before the pause
    # the sync's phases as `weight_sync/<phase>` spans (docs/metrics.md#weight-sync-spans)
    spans: tuple[TimelineEvent, ...] = ()


@dataclass(frozen=True)
class SyncReport:
    """Trainer rank 0's account of one weight sync (bucket export + push), wall-clock and durations."""

    start: float  # unix seconds
    end: float
    push_seconds: float  # the servers' pause -> resume
    transfer_seconds: float
    trainer_seconds: float
    paused_seconds: float
    spans: tuple[TimelineEvent, ...] = ()  # the push's phases (children of the weight_sync event)
    attrs: dict = field(default_factory=dict)  # where it ran (rank, node, gpu): added to every event

    @classmethod
    def of_push(cls, start: float, end: float, result: PushResult, attrs: dict | None = None) -> SyncReport:
        return cls(
            start=start,
            end=end,
            push_seconds=result.paused_seconds,
            transfer_seconds=result.transfer_seconds,
            trainer_seconds=result.trainer_seconds,
            paused_seconds=result.paused_seconds,
            spans=result.spans,
            attrs=dict(attrs or {}),
        )

    def timeline_events(self, version: int, target: UpdateTarget) -> list[TimelineEvent]:
        """The run store's ``weight_sync`` event (its attrs feed the ``timing_weight_sync_*``
        metrics), then its phases, each with the update's ``version`` and ``target``."""
        tags = {**self.attrs, "version": version, "target": UpdateTarget(target).value}
        children = [
            TimelineEvent(s.name, s.start, s.end, s.component, {**s.attrs, **tags}) for s in self.spans
        ]
        parent = self._parent(version, target)
        parent.attrs.update(self.attrs)
        return [parent, *children]

    def _parent(self, version: int, target: UpdateTarget) -> TimelineEvent:
        return TimelineEvent(
            "weight_sync",
            self.start,
            self.end,
            component="trainer",
            attrs={
                "version": version,
                "target": UpdateTarget(target).value,
                "push_seconds": self.push_seconds,
                "transfer_seconds": self.transfer_seconds,
                # the trainer's whole time in the sync, and how long the servers were paused
                "trainer_seconds": self.trainer_seconds,
                "paused_seconds": self.paused_seconds,
            },
        )
