"""The rules a Megatron-Core parallel layout must follow, checked when the config loads.

A run's trainer ranks form a grid TP x PP x CP x DP: tensor parallelism splits every layer's
matrices, pipeline parallelism gives each stage a contiguous range of layers, context parallelism
splits every packed row (refractor's own, with any of the others: ``forward.py``), and data
parallelism takes the ranks left over. Expert parallelism shares
the CP x DP ranks among a mixture-of-experts model's experts. Each broken rule is one line naming
the keys to change; the model's shape is checked when its ``config.json`` is on this machine.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

TP_KEY = "`megatron_tensor_parallel_size`"
PP_KEY = "`megatron_pipeline_parallel_size`"
CP_KEY = "`megatron_context_parallel_size`"
EP_KEY = "`megatron_expert_parallel_size`"
TE_KEY = "`megatron_use_transformer_engine: true`"
TE_INSTALL = "pip install 'transformer-engine[pytorch]'"
# Megatron-Core's MoE layer takes each TP rank's block of the sequence (its dispatcher gathers the
# tokens of the TP x EP ranks to the experts' TP shards): under TP it trains with sequence parallelism only
MOE_TENSOR_PARALLEL = (
    f"a mixture-of-experts model with {TP_KEY} > 1 needs `megatron_sequence_parallel: true` (Megatron-Core's "
    "MoE layer takes each tensor-parallel rank's block of the sequence)"
)


@dataclass(frozen=True)
class ParallelSizes:
    """The parallel sizes a config asks for; data parallelism is what the ranks leave over."""

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    sequence_parallel: bool = False

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one copy of the model (one data-parallel replica)."""
        return self.tensor * self.pipeline * self.context

    def data_parallel(self, ranks: int) -> int:
        return ranks // self.model_parallel

    def describe(self, ranks: int) -> str:
        return (
            f"TP {self.tensor} x PP {self.pipeline} x CP {self.context} x DP {self.data_parallel(ranks)} "
            f"= {ranks} trainer ranks"
        )


@dataclass(frozen=True)
class ModelShape:
    """The facts of an HF ``config.json`` that a parallel layout depends on."""

    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    num_experts: int = 0  # 0: a dense model
    moe_refusal: str | None = None  # why the trainer does not train this MoE model (``experts.py``)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelShape:
        from refractor.megatron.experts import moe_refusal

        heads = raw["num_attention_heads"]
        # Qwen2/3-MoE name the expert count num_experts, Mixtral num_local_experts
        experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
        return cls(
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            num_hidden_layers=raw["num_hidden_layers"],
            num_experts=experts,
            moe_refusal=moe_refusal(raw) if experts else None,
        )


def read_model_shape(model: str) -> ModelShape | None:
    """The shape of ``model`` when its ``config.json`` can be read without a download, else None
    (the run then fails on the missing model when it starts)."""
    from refractor.hub import ModelNotFoundError, resolve_model_path
    from refractor.models import read_hf_config

    try:
        return ModelShape.from_hf(read_hf_config(resolve_model_path(model)))
    except (ModelNotFoundError, OSError, KeyError, ValueError):
        return None


def transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def layout_errors(
    sizes: ParallelSizes,
    ranks: int,
    shape: ModelShape | None,
    *,
    use_transformer_engine: bool,
    fp8: bool,
    transformer_engine_present: bool,
) -> list[str]:
    """Every broken layout rule, one line each naming the keys (empty: the layout is valid)."""
    errors: list[str] = []
    if ranks % sizes.model_parallel:
        errors.append(
            f"`trainer_num_workers` ({ranks}) must be a multiple of {TP_KEY} x {PP_KEY} x {CP_KEY} "
            f"= {sizes.tensor} x {sizes.pipeline} x {sizes.context} = {sizes.model_parallel} "
            "(data parallelism takes the ranks left over)"
        )
    elif (ranks // (sizes.tensor * sizes.pipeline)) % sizes.expert:
        errors.append(
            f"{EP_KEY} ({sizes.expert}) must divide the context x data parallel ranks "
            f"({ranks // (sizes.tensor * sizes.pipeline)}): the experts are shared among them"
        )
    if sizes.expert > 1 and sizes.context > 1:
        errors.append(
            f"{EP_KEY} ({sizes.expert}) with {CP_KEY} ({sizes.context}): expert parallelism over "
            "context-parallel ranks is not built; set one of them to 1"
        )
    if sizes.sequence_parallel and sizes.tensor == 1:
        errors.append(
            f"`megatron_sequence_parallel: true` needs {TP_KEY} > 1 (it splits the sequence among the "
            "tensor-parallel ranks); set it to false"
        )
    if fp8 and not use_transformer_engine:
        errors.append(f"`megatron_fp8: true` needs {TE_KEY}: FP8 GEMMs come from Transformer Engine")
    if use_transformer_engine and not transformer_engine_present:
        errors.append(f"{TE_KEY} needs the transformer_engine package, which is not installed ({TE_INSTALL})")
    if shape is not None:
        errors += _shape_errors(sizes, shape)
    return errors


def _shape_errors(sizes: ParallelSizes, shape: ModelShape) -> list[str]:
    errors: list[str] = []
    for name, count in (
        ("num_attention_heads", shape.num_attention_heads),
        ("num_key_value_heads", shape.num_key_value_heads),
    ):
        if count % sizes.tensor:
            errors.append(
                f"{TP_KEY} ({sizes.tensor}) must divide the model's `{name}` ({count}): each "
                "tensor-parallel rank holds whole heads"
            )
    if shape.num_hidden_layers % sizes.pipeline:
        errors.append(
            f"{PP_KEY} ({sizes.pipeline}) must divide the model's `num_hidden_layers` "
            f"({shape.num_hidden_layers}): each pipeline stage holds as many layers"
        )
    if sizes.expert > 1 and not shape.num_experts:
        errors.append(
            f"{EP_KEY} ({sizes.expert}) needs a mixture-of-experts model; this model is dense: set it to 1"
        )
    elif shape.num_experts % sizes.expert:
        errors.append(f"{EP_KEY} ({sizes.expert}) must divide the model's expert count ({shape.num_experts})")
    return errors
