"""A Triton kernel the engine uses only on CUDA, and only once it matched its torch reference on
this device (a failed import, compile or check leaves the torch path, with one warning)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


class CheckedKernel:
    def __init__(self, what: str, fallback: str, load: Callable[[torch.device], Callable[..., Any]]):
        """``load(device)`` imports the kernel, checks it (raising on a mismatch) and returns it."""
        self.what = what
        self.fallback = fallback
        self._load = load
        self._kernel: Callable[..., Any] | None | bool = None  # None: not tried; False: unavailable

    def available(self, device: torch.device) -> bool:
        if device.type != "cuda":
            return False
        if self._kernel is None:
            try:
                self._kernel = self._load(device)
            except Exception as err:
                log.warning("%s unavailable (%s); using %s", self.what, err, self.fallback)
                self._kernel = False
        return bool(self._kernel)

    def __call__(self, *args, **kwargs):
        return self._kernel(*args, **kwargs)
