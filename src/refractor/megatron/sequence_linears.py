"""Megatron-Core's tensor-parallel linears for sequence parallelism (``sequence_parallel.py``): the
GEMM is Megatron-Core's, run without its own communication, between refractor's sequence collectives.
Imported where the model is built (it needs megatron-core)."""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from refractor.megatron.sequence_parallel import gather_sequence, reduce_scatter_sequence


class SequenceColumnLinear(ColumnParallelLinear):
    """A column-parallel linear whose input is this rank's block of the sequence: gathered first."""

    def __init__(self, *args, **kwargs):
        kwargs["disable_grad_reduce"] = True  # the gather's backward sums the input gradient
        super().__init__(*args, **kwargs)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        return super().forward(
            gather_sequence(input_, self.tp_group), weight=weight, runtime_gather_output=runtime_gather_output
        )


class SequenceRowLinear(RowParallelLinear):
    """A row-parallel linear whose partial sums are reduce-scattered along the sequence."""

    def forward(self, input_):
        output = reduce_scatter_sequence(
            self._forward_impl(
                input=input_,
                weight=self.weight,
                bias=None,
                gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                allreduce_dgrad=False,
                sequence_parallel=False,
                tp_group=None,
                grad_output_buffer=None,
            ),
            self.tp_group,
        )
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None
