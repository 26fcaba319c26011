"""Host -> device copies that do not wait for the device."""

from __future__ import annotations

import numpy as np
import torch


def to_device(x: torch.Tensor | np.ndarray | list, device: torch.device) -> torch.Tensor:
    """Queue a copy of host data to ``device`` and return at once.

    On CUDA the data goes through pinned memory first: a copy from pageable memory may wait for
    the work already queued on the stream, which would undo running the host one step ahead of
    the device. Torch's pinned-memory cache keeps the buffer until the copy is done.
    """
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    elif not isinstance(x, torch.Tensor):
        x = torch.tensor(x)
    if device.type == "cuda":
        x = x.pin_memory()
    return x.to(device, non_blocking=True)
