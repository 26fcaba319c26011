"""torch's CUDA memory of one process (a trainer rank, a native inference server), sampled often.

``torch_memory_gb(device)`` reads the caching allocator: ``torch_allocated_gb`` (tensors),
``torch_reserved_gb`` (held by the allocator) and ``torch_max_allocated_gb`` (the peak since the
process started or the trainer's last step reset it). On a CPU device it reads nothing: torch
keeps no allocator statistics there.

:class:`TorchMemoryRecorder` samples in a daemon thread every ``interval_s`` into a bounded buffer
that a caller drains (the driver, over Ray, every ``ray_torch_memory_drain_interval_seconds``); a
full buffer drops its oldest samples and counts them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

GB = 2**30
MAX_BUFFERED_SAMPLES = 10_000  # ~17 min at the default 0.1 s when nobody drains


def torch_memory_gb(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {
        "torch_allocated_gb": torch.cuda.memory_allocated(device) / GB,
        "torch_reserved_gb": torch.cuda.memory_reserved(device) / GB,
        "torch_max_allocated_gb": torch.cuda.max_memory_allocated(device) / GB,
    }


class TorchMemoryRecorder:
    def __init__(
        self,
        read: Callable[[], dict[str, float]],
        interval_s: float,
        capacity: int = MAX_BUFFERED_SAMPLES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.read = read
        self.interval_s = interval_s
        self.clock = clock
        self._samples: collections.deque[tuple[float, dict[str, float]]] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0
        self.error: str | None = None  # why sampling stopped (the read raised), reported by drain

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="torch-memory", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        values = self.read()
        with self._lock:
            if len(self._samples) == self._samples.maxlen:
                self.dropped += 1
            self._samples.append((self.clock(), values))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as err:  # noqa: BLE001 - a broken reading ends sampling, not the rank
                self.error = f"{type(err).__name__}: {err}"
                log.warning("torch memory sampling stopped: %s", self.error)
                return

    def drain(self) -> list[tuple[float, dict[str, float]]]:
        """The samples taken since the last drain, oldest first."""
        with self._lock:
            out = list(self._samples)
            self._samples.clear()
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
