"""Book-keeping of one group between dispatch and completion (or cancellation)."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from refractor.orchestrator.rollout import PreparedPrompt
from refractor.records import Group


@dataclass
class InFlightGroup:
    group: Group
    prompt: PreparedPrompt
    server: str  # every sample of a group runs on the group's server
    queued: deque[int] = field(default_factory=deque)  # samples not started yet (individual lanes)
    lanes: dict[int, int] = field(default_factory=dict)  # sample index -> lane it holds now
    tasks: dict[int, asyncio.Task] = field(default_factory=dict)
    remaining: int = 0
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.remaining = len(self.group.rollouts)

    def holder(self, sample_idx: int) -> tuple[int, int]:
        """Lane holder key: (group id, sample index)."""
        return (self.group.group_id, sample_idx)
