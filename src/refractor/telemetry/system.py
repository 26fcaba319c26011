"""Driver-node system metrics (docs/metrics.md#system-metrics), read with psutil: CPU utilization
between two samples, and memory. :class:`SystemMetricsLoop` stores a sample every interval with
source ``driver``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import psutil

GB = 1024**3


def _busy_and_total(times: Any) -> tuple[float, float]:
    """CPU seconds (all cores) spent busy and in total; idle counts I/O wait too."""
    total = float(sum(times))
    idle = times.idle + getattr(times, "iowait", 0.0)
    return total - idle, total


class SystemSampler:
    """``cpu_times`` and ``virtual_memory`` are psutil's functions (tests pass stand-ins)."""

    def __init__(
        self,
        cpu_times: Callable[[], Any] = psutil.cpu_times,
        virtual_memory: Callable[[], Any] = psutil.virtual_memory,
    ) -> None:
        self.cpu_times = cpu_times
        self.virtual_memory = virtual_memory
        self._last = _busy_and_total(cpu_times())

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        now = _busy_and_total(self.cpu_times())
        total = now[1] - self._last[1]
        if total > 0:
            out["cpu_utilization_percent"] = 100.0 * (now[0] - self._last[0]) / total
        self._last = now
        mem = self.virtual_memory()
        used = mem.total - mem.available  # what the machine cannot hand out (not psutil's narrower `used`)
        out["system_memory_used_gb"] = used / GB
        out["system_memory_available_gb"] = mem.available / GB
        out["system_memory_percent"] = 100.0 * used / mem.total
        return out


class SystemMetricsLoop:
    """Every ``interval_s``, one sample handed to ``log_metrics(source, metrics, timestamp)``."""

    def __init__(
        self,
        log_metrics: Callable[[str, dict[str, float], float], None],
        interval_s: float,
        clock: Callable[[], float] = time.time,
        sampler: SystemSampler | None = None,
    ) -> None:
        self.log_metrics = log_metrics
        self.interval_s = interval_s
        self.clock = clock
        self.sampler = sampler

    async def run(self) -> None:
        sampler = self.sampler or SystemSampler()  # the first CPU reading starts with the loop
        while True:
            await asyncio.sleep(self.interval_s)
            metrics = sampler.sample()
            if metrics:
                self.log_metrics("driver", metrics, self.clock())
