"""Workarounds for two vLLM 0.32 CPU bugs that make in-place weight updates silently wrong.

vLLM's CPU linear and MoE kernels keep *repacked copies* of weights made at load time. Layerwise
reload (used by every in-place update path, ours included) re-processes layers as their weights
arrive, but:
  1. a tied ``lm_head`` shares ``embed_tokens.weight``; only the embedding layer is re-processed,
     so the lm_head's oneDNN handle keeps packing the OLD matrix (logits off by ~1 nat);
  2. CPU MoE experts skip their prepack on weight updates, so experts read unpacked bytes.
Both only bite when packing is active (fp32, or bf16 on AVX512-BF16/AMX hosts). On GPU both
functions do nothing. Call ``refresh_cpu_kernels`` after ``finalize_layerwise_reload``.
"""

from __future__ import annotations

import torch


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or not hasattr(lm_head, "cpu_linear"):
        return False
    if getattr(lm_head, "weight", None) is not getattr(embed, "weight", None):
        return False  # untied: the lm_head layer was re-processed by the reload itself
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)  # the embedding still needs .weight
    return True


def repack_moe_experts(model: torch.nn.Module) -> int:
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise NotImplementedError(
                "in-place weight updates of CPU MoE layers with a padded intermediate size are not supported "
                "by vLLM 0.32's CPU kernels; use a GPU or reload from disk"
            )
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(module, name)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
        repacked += 1
    return repacked


def refresh_cpu_kernels(model: torch.nn.Module) -> dict[str, int]:
    if not _on_cpu():
        return {"tied_lm_head": 0, "moe_layers": 0}
    return {"tied_lm_head": int(refresh_tied_lm_head(model)), "moe_layers": repack_moe_experts(model)}
