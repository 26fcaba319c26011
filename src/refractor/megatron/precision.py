"""The Megatron trainer's precision: float32 master weights, the model's copies in the compute dtype.

``mixed_precision_dtype`` (bfloat16 / float16) is the dtype of the model's parameters, so every GEMM,
norm, rotary product, the attention, the residual stream and the activations that pipeline stages send
each other run in it, as the FSDP2 trainer's compute runs (its ``MixedPrecisionPolicy`` hands the
layers bf16 parameters). The rest stays float32:

* each model parameter has a float32 master copy: AdamW steps the masters (its moments are float32),
  the weight export and the checkpoints read them;
* autograd's gradient of a model parameter is added into its master's float32 gradient as soon as it
  is complete (a post-accumulate hook), and the low-precision gradient is freed: the rows of a
  minibatch accumulate, the tensor-parallel, tied-embedding and data-parallel sums reduce, and the
  norm and the clip run on float32 gradients (``megatron_main_grads_dtype: bfloat16`` keeps them in
  the bf16 compute dtype instead: accumulated and reduced in bf16, upcast for the update;
  ``megatron_grad_reduce_in_fp32: false`` reduces the float32 gradients over the data-parallel
  replicas in the compute dtype);
* after each AdamW update the masters are rounded into the model's parameters (``refresh``).

This is also how Megatron-Core trains in bf16 (``Float16Module``, float32 ``main_grad`` buffers, float32
main parameters in its optimizer), here without its CUDA-only buffers. ``torch.autocast`` over float32
parameters is not used: megatron-core's linear autograd functions restore the autocast state in their
backward for CUDA only (``custom_bwd(device_type="cuda")``), so on CPU a ``ColumnParallelLinear``
backward run outside the autocast region multiplies a bf16 gradient by the float32 weight and fails,
and a plain ``autograd.Function`` such as the vocabulary-parallel head runs its backward under
whatever autocast state the autograd thread has: the same step would compute differently on CPU and
CUDA. Autocast would also keep the residual stream, and with it the pipeline sends, in float32
(bf16 + fp32 promotes to fp32).

With the compute dtype float32 the model's parameters are the masters (nothing is copied). float16
gets no loss scaling, as in the FSDP2 trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch

MASTER_DTYPE = torch.float32


def _add_to_master(master: torch.nn.Parameter, param: torch.nn.Parameter) -> None:
    """Post-accumulate hook of a model parameter: its gradient goes into the master's, in float32."""
    if master.grad is None:
        master.grad = param.grad.to(master.dtype)
    else:
        master.grad.add_(param.grad)
    param.grad = None


class MasterWeights:
    """The model's parameters (``compute``, name -> parameter), their float32 masters (``master``: the
    same objects when the model is float32), and the parameters whose ``.grad`` is the gradient that
    is accumulated, reduced and clipped (``grads``): the masters, or with ``grads_in_compute_dtype``
    (``megatron_main_grads_dtype: bfloat16``) the model's own parameters, whose low-precision gradients
    autograd accumulates in their dtype."""

    def __init__(self, model: torch.nn.Module, grads_in_compute_dtype: bool = False):
        self.compute = dict(model.named_parameters())
        self.mixed = any(p.dtype != MASTER_DTYPE for p in self.compute.values())
        if not self.mixed:
            self.master = self.grads = self.compute
            return
        self.master = {
            name: torch.nn.Parameter(torch.empty_like(p, dtype=MASTER_DTYPE), requires_grad=p.requires_grad)
            for name, p in self.compute.items()
        }
        if grads_in_compute_dtype:
            self.grads = self.compute
            return
        self.grads = self.master
        for name, p in self.compute.items():
            p.register_post_accumulate_grad_hook(partial(_add_to_master, self.master[name]))

    @torch.no_grad()
    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Set the masters from ``state`` (the model's own state dict names, float32 values), then the
        model's parameters from the masters. The model has loaded ``state`` itself (names checked)."""
        if not self.mixed:
            return
        for name, master in self.master.items():
            master.copy_(state[name])
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Round the masters into the model's parameters (after an update or a load)."""
        if self.mixed:
            names = list(self.master)
            torch._foreach_copy_([self.compute[n] for n in names], [self.master[n] for n in names])


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16`` (as the config keys name dtypes)."""
    return str(dtype).removeprefix("torch.")
