"""System metrics from a fake /proc (hand-computed) and from the real one (sanity)."""

import pytest

from refractor.telemetry.system import SystemSampler


def write_proc(root, user, idle):
    (root / "stat").write_text(f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 0 0 1\n")
    (root / "meminfo").write_text("MemTotal:       4194304 kB\nMemFree:  1 kB\nMemAvailable:   1048576 kB\n")


def test_hand_computed(tmp_path):
    write_proc(tmp_path, 100, 100)
    sampler = SystemSampler(tmp_path)
    write_proc(tmp_path, 130, 170)  # +30 busy, +70 idle
    m = sampler.sample()
    assert m["cpu_utilization_percent"] == pytest.approx(30.0)
    assert m["system_memory_used_gb"] == pytest.approx(3.0) and m[
        "system_memory_available_gb"
    ] == pytest.approx(1.0)
    assert m["system_memory_percent"] == pytest.approx(75.0)


def test_real_proc_is_sane():
    m = SystemSampler().sample()
    assert 0 < m["system_memory_percent"] < 100
