"""Profile a few calls of a step function: torch.profiler tables + a cProfile of the host side.

Used by ``bench_trainer.py --profile``. Writes, under ``out_dir`` with ``prefix``:
* ``<prefix>_summary.json``: wall time per step, GPU kernel time per step (sum of kernel
  durations), kernel launches, host<->device syncs (cudaStreamSynchronize / cudaDeviceSynchronize /
  cudaMemcpy(Async) D2H counts) -- GPU time << wall time means the host is the bottleneck;
* ``<prefix>_cpu.txt`` / ``<prefix>_gpu.txt``: ``key_averages`` tables by self CPU / device time;
* ``<prefix>_pystats.txt``: cProfile of one step (Python functions by total and own time);
* ``<prefix>_trace.json.gz``: the Chrome trace of the profiled steps (open in Perfetto).
"""

from __future__ import annotations

import cProfile
import gzip
import io
import json
import os
import pstats
import shutil
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_steps(step: Callable[[], object], out_dir: str, prefix: str, steps: int = 2) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, prefix)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=False) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / steps
    events = prof.events()
    kernel_us = sum(e.device_time for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    names = [e.name for e in events]
    summary = {
        "wall_ms_per_step": wall * 1e3,
        "gpu_kernel_ms_per_step": kernel_us / 1e3 / steps,
        "gpu_busy_fraction": kernel_us / 1e6 / steps / wall,
        "kernel_launches_per_step": sum(
            n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
            for n in names
        )
        / steps,
        "syncs_per_step": {op: names.count(op) / steps for op in SYNC_OPS},
        "memcpy_per_step": {op: names.count(op) / steps for op in ("cudaMemcpyAsync", "cudaMemcpy")},
    }
    averages = prof.key_averages()
    with open(f"{path}_cpu.txt", "w") as f:
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=90))
    with open(f"{path}_gpu.txt", "w") as f:
        f.write(averages.table(sort_by="self_device_time_total", row_limit=60, max_name_column_width=90))
    trace = f"{path}_trace.json"
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(trace)

    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(70)
    stats.sort_stats("tottime").print_stats(50)
    with open(f"{path}_pystats.txt", "w") as f:
        f.write(text.getvalue())
    with open(f"{path}_summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    return summary
