"""What the orchestrator needs from the parts it is given (Ray actors, HTTP clients or test fakes)."""

from __future__ import annotations

from typing import Any, Protocol

from refractor.records import Rollout, StepResult, TimelineEvent, TrainSample
from refractor.weight_sync import UpdateTarget


class Trainer(Protocol):
    async def train_step(self, step: int, samples: list[TrainSample]) -> StepResult: ...

    async def update_weights(
        self, version: int, target: UpdateTarget = UpdateTarget.FULL
    ) -> list[TimelineEvent] | None:
        """Send the weights after ``version`` steps to the servers of ``target`` (``full``: every
        server; ``training_only``: all but the eval servers); return when they all hold them."""

    async def save_checkpoint(
        self, step: int, orchestrator_state: dict[str, Any]
    ) -> list[TimelineEvent] | None:
        """Save on every rank; return the ranks' ``checkpoint`` spans (or None)."""


class SleepingServer(Protocol):
    """A server that gives its GPU memory back while the trainer steps (colocated synchronous runs)."""

    async def sleep(self, level: int = 1, mode: str = "keep") -> None:
        """Release the memory once the requests in flight are dealt with as ``mode`` says (``abort``,
        ``keep``: frozen until the wake, ``wait``: finished first)."""

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory of ``tags`` (``weights``, ``kv_cache``; None: all of it)."""


class StepSink(Protocol):
    """A consumer of training progress (console, W&B)."""

    def log_step(self, step: int, metrics: dict[str, float], rollouts: list[Rollout]) -> None: ...

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Eval metrics ``eval/<name>/<metric>`` of the reported eval step."""

    def warn(self, message: str) -> None:
        """A run-level warning (e.g. training starved)."""

    def close(self) -> None: ...


class TelemetryLoop(Protocol):
    """A periodic collector (system metrics, server metrics) that runs while the orchestrator trains."""

    async def run(self) -> None: ...


class LatencySource(Protocol):
    """Each request's latency as its server reported it apart from the answer (vLLM's trace spans)."""

    async def take(self, request_id: str, timeout_s: float) -> dict[str, float] | None:
        """The latency (seconds by phase) of the request the server knows as ``request_id``; None if it
        has not arrived within ``timeout_s``."""
