"""System metrics from stand-in psutil readings (hand-computed) and from the real machine (sanity);
GPU metrics through a stand-in NVML with pynvml's functions and error classes (no GPU here)."""

from __future__ import annotations

import logging
import time
from collections import namedtuple
from types import SimpleNamespace

import pynvml
import pytest

from refractor.telemetry.system import (
    GB,
    GpuSampler,
    NodeSampler,
    SystemSampler,
    describe_gpus,
    describe_machine,
    visible_gpu_indices,
)

CpuTimes = namedtuple("CpuTimes", "user nice system idle iowait")
Memory = namedtuple("Memory", "total available")


class Readings:
    """psutil's ``cpu_times(percpu)`` and ``virtual_memory()`` for a two-core machine."""

    def __init__(self, cores: list[tuple[float, float, float]]):
        self.cores = cores  # (user, idle, iowait) per core

    def cpu_times(self, percpu: bool = False):
        per_core = [CpuTimes(user, 0.0, 0.0, idle, iowait) for user, idle, iowait in self.cores]
        if percpu:
            return per_core
        return CpuTimes(*(sum(t[i] for t in per_core) for i in range(5)))

    def virtual_memory(self):
        return Memory(4 * GB, 1 * GB)


def test_hand_computed_total_per_core_and_memory():
    readings = Readings([(50.0, 50.0, 0.0), (50.0, 50.0, 0.0)])
    sampler = SystemSampler(readings.cpu_times, readings.virtual_memory)
    readings.cores = [(80.0, 70.0, 0.0), (50.0, 100.0, 0.0)]  # core 0: +30 busy +20 idle; core 1: +50 idle
    m = sampler.sample()
    assert m["cpu_utilization_percent"] == pytest.approx(30.0)
    assert m["cpu_core_0_utilization_percent"] == pytest.approx(60.0)
    assert m["cpu_core_1_utilization_percent"] == pytest.approx(0.0)
    assert m["system_memory_used_gb"] == pytest.approx(3.0)
    assert m["system_memory_available_gb"] == pytest.approx(1.0)
    assert m["system_memory_percent"] == pytest.approx(75.0)


def test_io_wait_counts_as_idle_and_no_cpu_metric_without_elapsed_time():
    readings = Readings([(100.0, 100.0, 0.0)])
    sampler = SystemSampler(readings.cpu_times, readings.virtual_memory)
    assert "cpu_utilization_percent" not in sampler.sample()
    readings.cores = [(110.0, 100.0, 10.0)]
    assert sampler.sample()["cpu_utilization_percent"] == pytest.approx(50.0)


def test_a_counter_stepping_backwards_stays_within_0_and_100_percent():
    """Idle may step back between readings on a virtual machine; the share is clamped, not 120%."""
    readings = Readings([(100.0, 100.0, 5.0), (100.0, 100.0, 0.0)])
    sampler = SystemSampler(readings.cpu_times, readings.virtual_memory)
    readings.cores = [
        (110.0, 100.0, 0.0),
        (100.0, 99.0, 0.0),
    ]  # core 0: I/O wait -5; core 1: idle -1, no elapsed time
    m = sampler.sample()
    assert m["cpu_core_0_utilization_percent"] == pytest.approx(100.0)
    assert "cpu_core_1_utilization_percent" not in m  # no time passed on its counters: no reading


def test_guest_time_is_not_counted_twice():
    Times = namedtuple("Times", "user nice system idle iowait guest guest_nice")
    now = [Times(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)]
    sampler = SystemSampler(lambda percpu=False: now if percpu else now[0], Readings([]).virtual_memory)
    now[0] = Times(20.0, 0.0, 0.0, 20.0, 0.0, 20.0, 0.0)  # the 20 s of guest time are inside user's 20 s
    assert sampler.sample()["cpu_utilization_percent"] == pytest.approx(50.0)


def test_real_machine_is_sane():
    sampler = SystemSampler()
    sum(i * i for i in range(200_000))  # some CPU time between the two readings
    # every core's counters advance by clock ticks (10 ms): wait for several, busy or idle, so that
    # each core has a reading
    time.sleep(0.2)
    m = sampler.sample()
    assert 0 < m["system_memory_percent"] < 100
    cores = [k for k in m if k.startswith("cpu_core_")]
    assert len(cores) == len(SystemSampler().cpu_times(percpu=True))
    assert all(0 <= m[k] <= 100 for k in cores)


@pytest.fixture(autouse=True)
def every_gpu_visible(monkeypatch):
    """The stand-in NVML's GPUs are all this process's unless a test sets ``CUDA_VISIBLE_DEVICES``."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


class FakeNvml:
    """pynvml's functions for two GPUs (or ``count``); GPU 1 has no fan (NotSupported) and its power
    read fails once with a transient error. The error classes are pynvml's own."""

    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_CLOCK_MEM = pynvml.NVML_CLOCK_MEM

    def __init__(self, count: int = 2, init_error: Exception | None = None):
        self.count = count
        self.init_error = init_error
        self.fan_calls = 0
        self.power_failures = 1

    def nvmlInit(self):
        if self.init_error is not None:
            raise self.init_error

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=80 * GB, used=(20 + h) * GB, free=(60 - h) * GB)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=90 + h, memory=40 + h)

    def nvmlDeviceGetPowerUsage(self, h):
        if h == 1 and self.power_failures:
            self.power_failures -= 1
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return 350_500 + h * 1000  # milliwatts

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return 60 + h

    def nvmlDeviceGetClockInfo(self, h, clock):
        return {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619}[clock]

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H100 80GB HBM3" if h == 0 else "NVIDIA H100 80GB HBM3"  # bytes in old pynvml

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}c4e81a2-5d1f-4b7e-9a3c-00000000000{h}"

    def nvmlSystemGetDriverVersion(self):
        return "570.86.15"

    def nvmlSystemGetCudaDriverVersion(self):
        return 12080

    def nvmlDeviceGetFanSpeed(self, h):
        self.fan_calls += 1
        if h == 1:
            raise pynvml.NVMLError_NotSupported(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 30


def test_gpu_metrics_per_gpu_with_nvml_units_converted():
    nvml = FakeNvml()
    sampler = GpuSampler.open(nvml)
    rows = {(source, name): value for source, name, value in sampler.sample()}
    assert rows[("gpu0", "gpu_memory_used_gb")] == 20.0 and rows[("gpu1", "gpu_memory_free_gb")] == 59.0
    assert rows[("gpu0", "gpu_memory_used_percent")] == pytest.approx(25.0)
    assert rows[("gpu1", "gpu_utilization_percent")] == 91.0
    assert rows[("gpu1", "gpu_memory_bandwidth_utilization_percent")] == 41.0
    assert rows[("gpu0", "gpu_power_w")] == pytest.approx(350.5)
    assert rows[("gpu0", "gpu_temperature_c")] == 60.0
    assert rows[("gpu0", "gpu_clock_sm_mhz")] == 1980.0 and rows[("gpu0", "gpu_clock_mem_mhz")] == 2619.0
    assert rows[("gpu0", "gpu_fan_speed_percent")] == 30.0
    # what one GPU cannot report is left out; a transient failure only this time
    assert ("gpu1", "gpu_fan_speed_percent") not in rows and ("gpu1", "gpu_power_w") not in rows
    rows = {(source, name): value for source, name, value in sampler.sample()}
    assert rows[("gpu1", "gpu_power_w")] == pytest.approx(351.5)
    assert nvml.fan_calls == 3  # GPU 1's fan is not asked again


def test_no_nvml_means_cpu_metrics_only_and_one_info_line(caplog):
    caplog.set_level(logging.INFO, logger="refractor.telemetry.system")
    missing = FakeNvml(init_error=pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    node = NodeSampler.open(missing)
    assert node.gpus is None
    assert [r.message for r in caplog.records] == [
        "no GPU metrics on this machine (NVML: NVML Shared Library Not Found)"
    ]
    assert {source for source, _, _ in node.sample()} == {"system"}
    assert GpuSampler.open(FakeNvml(count=0)) is None


def test_node_sampler_rows_carry_system_and_gpu_sources():
    node = NodeSampler(SystemSampler(), GpuSampler.open(FakeNvml()))
    sources = {source for source, _, _ in node.sample()}
    assert sources == {"system", "gpu0", "gpu1"}


def test_the_real_nvml_on_a_machine_without_gpus_gives_no_sampler():
    # this machine has no NVIDIA driver: the real library load fails, and that is not an error
    if GpuSampler.open() is not None:
        pytest.skip("this machine has an NVIDIA GPU")


def test_machine_description_names_gpus_driver_and_cuda():
    described = describe_gpus(FakeNvml())
    assert described["driver_version"] == "570.86.15" and described["cuda_driver_version"] == "12.8"
    assert [g["name"] for g in described["gpus"]] == ["NVIDIA H100 80GB HBM3"] * 2
    assert described["gpus"][1] == {
        "index": 1,
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": "GPU-1c4e81a2-5d1f-4b7e-9a3c-000000000001",
        "memory_gb": 80.0,
    }
    missing = describe_gpus(FakeNvml(init_error=pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)))
    assert missing == {"gpus": [], "error": "NVML Shared Library Not Found"}
    machine = describe_machine(FakeNvml())
    assert machine["packages"]["torch"] and machine["cpu_count"] >= 1 and len(machine["gpus"]) == 2


def visible(monkeypatch, listed: str, count: int = 4) -> list[int]:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    return visible_gpu_indices(FakeNvml(count))


def test_without_cuda_visible_devices_every_gpu_is_visible():
    assert visible_gpu_indices(FakeNvml(4)) == [0, 1, 2, 3]


def test_visible_gpus_are_in_the_listed_order_and_end_at_the_first_invalid_entry(monkeypatch):
    assert visible(monkeypatch, "1,0") == [1, 0]
    assert visible(monkeypatch, "2,7,0") == [2]  # 7 is no GPU of four: 0 after it is not visible
    assert visible(monkeypatch, "0,2,-1,1") == [0, 2]  # CUDA's documented example
    assert visible(monkeypatch, "0,gpu1") == [0]


def test_empty_minus_one_and_no_dev_files_mean_no_gpu(monkeypatch):
    for listed in ("", "-1", "NoDevFiles"):
        assert visible(monkeypatch, listed) == []


def test_a_gpu_listed_twice_leaves_none(monkeypatch):
    assert visible(monkeypatch, "1,0,1") == []


def test_gpus_named_by_uuid_or_a_unique_uuid_prefix(monkeypatch):
    assert visible(monkeypatch, "GPU-3c4e81a2-5d1f-4b7e-9a3c-000000000003,GPU-1c4e") == [3, 1]
    assert visible(monkeypatch, "GPU-2,GPU-ffff,1") == [2]  # a UUID no GPU has ends the list
    assert visible(monkeypatch, "GPU-2,GPU-,1") == [2]  # so does a prefix of several GPUs' UUIDs


def test_mig_instances_fall_back_to_every_gpu_with_one_info_line(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="refractor.telemetry.system")
    assert visible(monkeypatch, "MIG-5a1e2b3c-0000-4000-8000-000000000000") == [0, 1, 2, 3]
    assert len(caplog.records) == 1 and "MIG" in caplog.records[0].message


def test_gpu_sampler_records_only_visible_gpus_by_their_nvml_index(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    rows = {(source, name): value for source, name, value in GpuSampler.open(FakeNvml(4)).sample()}
    assert {source for source, _ in rows} == {"gpu3", "gpu1"}
    assert rows[("gpu3", "gpu_memory_used_gb")] == 23.0  # GPU 3's own reading, not CUDA device 0's


def test_no_visible_gpu_means_no_gpu_sampler_and_one_info_line(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="refractor.telemetry.system")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert GpuSampler.open(FakeNvml(4)) is None
    assert [r.message for r in caplog.records] == [
        "no GPU metrics: CUDA_VISIBLE_DEVICES='' names none of NVML's GPUs"
    ]


def test_machine_description_lists_only_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-2c4e,GPU-0")
    described = describe_gpus(FakeNvml(4))
    assert [(g["index"], g["uuid"]) for g in described["gpus"]] == [
        (2, "GPU-2c4e81a2-5d1f-4b7e-9a3c-000000000002"),
        (0, "GPU-0c4e81a2-5d1f-4b7e-9a3c-000000000000"),
    ]
