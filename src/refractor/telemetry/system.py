"""Driver-node system metrics from /proc (reference §8.5 names): CPU utilization between two
samples, and memory. Linux only; elsewhere ``sample()`` returns an empty dict."""

from __future__ import annotations

from pathlib import Path


def _cpu_times(proc: Path) -> tuple[int, int] | None:
    try:
        fields = (proc / "stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values), idle


def _meminfo(proc: Path) -> dict[str, int]:
    out = {}
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024  # kB -> bytes
    except (OSError, ValueError, IndexError):
        return {}
    return out


class SystemSampler:
    def __init__(self, proc: str | Path = "/proc") -> None:
        self.proc = Path(proc)
        self._last = _cpu_times(self.proc)

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        now = _cpu_times(self.proc)
        if now is not None and self._last is not None and now[0] > self._last[0]:
            total, idle = now[0] - self._last[0], now[1] - self._last[1]
            out["cpu_utilization_percent"] = 100.0 * (total - idle) / total
        self._last = now
        mem = _meminfo(self.proc)
        if "MemTotal" in mem and "MemAvailable" in mem:
            gb = 1024**3
            used = mem["MemTotal"] - mem["MemAvailable"]
            out["system_memory_used_gb"] = used / gb
            out["system_memory_available_gb"] = mem["MemAvailable"] / gb
            out["system_memory_percent"] = 100.0 * used / mem["MemTotal"]
        return out
