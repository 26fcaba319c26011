"""CPU offload of the Megatron trainer's optimizer (``megatron_optimizer_cpu_offload``): a share of the
parameters is stepped on the host, as Megatron-Core's ``HybridDeviceOptimizer`` steps it.

``megatron_optimizer_offload_fraction`` picks the parameters as Megatron-Core picks them: in the
rank's parameter order, a parameter goes to the host while the host holds fewer than that fraction of
the elements (0: none, 1: all). An offloaded parameter has a float32 copy of its master weight on the
host, and its AdamW state lives beside that copy; each step copies its gradient to the host (upcast to
float32), AdamW steps the host copy there, and the updated weight is copied back into the device
master, from which the model's parameter, the weight export and the checkpoints read it.

``megatron_overlap_cpu_optimizer_d2h_h2d`` (CUDA only): the host copies and gradient buffers are in
pinned memory and both copies run on a side stream, asynchronous to the compute stream: the device
part of the update is launched while the gradients travel, the host waits for them before it steps
its part, and the compute stream waits for the weights before it reads them. Without it, or when the
"device" is the CPU itself, the copies are plain synchronous copies between separate tensors.
"""

from __future__ import annotations

import contextlib

import torch

from refractor.megatron.precision import MASTER_DTYPE


def offloaded(sizes: list[int], fraction: float) -> list[bool]:
    """Which parameters (by element count, in order) go to the host: each while the host holds fewer
    than ``fraction`` of all elements."""
    threshold = fraction * sum(sizes)
    held = 0
    out = []
    for size in sizes:
        out.append(held < threshold)
        if out[-1]:
            held += size
    return out


class HostCopies:
    """Host copies of the offloaded device masters (``masters``: name -> parameter), each with a host
    gradient buffer as its ``.grad``."""

    def __init__(self, masters: dict[str, torch.nn.Parameter], overlap: bool):
        self.masters = masters
        on_cuda = any(p.is_cuda for p in masters.values())
        self.stream = torch.cuda.Stream() if overlap and on_cuda else None
        pinned = self.stream is not None
        self.params = {}
        for name, master in masters.items():
            host = torch.nn.Parameter(
                torch.empty(master.shape, dtype=MASTER_DTYPE, device="cpu", pin_memory=pinned)
            )
            host.grad = torch.empty(master.shape, dtype=MASTER_DTYPE, device="cpu", pin_memory=pinned)
            self.params[name] = host
        self.weights_in()

    @contextlib.contextmanager
    def _copies(self):
        """The side stream (after the compute stream's work so far), or the current one."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield

    @torch.no_grad()
    def gradients_in(self, grads: dict[str, torch.Tensor]) -> None:
        """Start copying the device gradients (name -> tensor, any float dtype) into the host buffers
        (``gradients_ready`` waits for them)."""
        with self._copies():
            for name, host in self.params.items():
                host.grad.copy_(grads[name], non_blocking=self.stream is not None)

    def gradients_ready(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    @torch.no_grad()
    def weights_out(self) -> None:
        """Copy the stepped host weights into the device masters; the compute stream waits for them."""
        with self._copies():
            for name, host in self.params.items():
                self.masters[name].copy_(host, non_blocking=self.stream is not None)
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)

    @torch.no_grad()
    def weights_in(self) -> None:
        """Set the host copies from the device masters (at the start and after a checkpoint load)."""
        if self.stream is not None:  # a copy of the last update may still read them
            self.stream.synchronize()
        for name, host in self.params.items():
            host.copy_(self.masters[name])
