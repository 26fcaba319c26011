"""System metrics from stand-in psutil readings (hand-computed), from the real machine (sanity), and
the loop that stores them."""

import asyncio
from collections import namedtuple

import pytest

from refractor.telemetry.system import SystemMetricsLoop, SystemSampler

CpuTimes = namedtuple("CpuTimes", "user nice system idle iowait")
Memory = namedtuple("Memory", "total available")
GB = 1024**3


class Readings:
    def __init__(self, user, idle):
        self.times = CpuTimes(user, 0.0, 0.0, idle, 0.0)

    def cpu_times(self):
        return self.times

    def virtual_memory(self):
        return Memory(4 * GB, 1 * GB)


def test_hand_computed():
    readings = Readings(100.0, 100.0)
    sampler = SystemSampler(readings.cpu_times, readings.virtual_memory)
    readings.times = CpuTimes(130.0, 0.0, 0.0, 170.0, 0.0)  # +30 busy, +70 idle
    m = sampler.sample()
    assert m["cpu_utilization_percent"] == pytest.approx(30.0)
    assert m["system_memory_used_gb"] == pytest.approx(3.0)
    assert m["system_memory_available_gb"] == pytest.approx(1.0)
    assert m["system_memory_percent"] == pytest.approx(75.0)


def test_io_wait_counts_as_idle_and_no_cpu_metric_without_elapsed_time():
    readings = Readings(100.0, 100.0)
    sampler = SystemSampler(readings.cpu_times, readings.virtual_memory)
    assert "cpu_utilization_percent" not in sampler.sample()
    readings.times = CpuTimes(110.0, 0.0, 0.0, 100.0, 10.0)
    assert sampler.sample()["cpu_utilization_percent"] == pytest.approx(50.0)


def test_real_machine_is_sane():
    m = SystemSampler().sample()
    assert 0 < m["system_memory_percent"] < 100


def test_loop_stores_driver_samples_every_interval():
    rows = []
    readings = Readings(100.0, 100.0)
    sampler = SystemSampler(readings.cpu_times, readings.virtual_memory)
    loop = SystemMetricsLoop(lambda *row: rows.append(row), 0.001, clock=lambda: 7.0, sampler=sampler)

    async def main():
        task = asyncio.create_task(loop.run())
        while len(rows) < 2:
            await asyncio.sleep(0.001)
        task.cancel()

    asyncio.run(main())
    source, metrics, timestamp = rows[0]
    assert source == "driver" and timestamp == 7.0 and metrics["system_memory_percent"] == pytest.approx(75.0)
