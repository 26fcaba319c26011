"""The few architecture facts the decoder needs, read from an HF ``config.json``.

One typed record instead of passing ``PretrainedConfig`` around: it accepts both the
transformers-4 layout (``rope_theta`` + ``rope_scaling``) and the transformers-5 one
(``rope_parameters``), and it is where unsupported checkpoints are refused with a clear message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from refractor.errors import RefractorUserError

# HF architecture name -> (model_type, attention has q/k/v bias by default, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "LlamaForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}
_ARCH_BY_MODEL_TYPE = {model_type: arch for arch, (model_type, _, _) in SUPPORTED_ARCHITECTURES.items()}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class UnsupportedModelError(RefractorUserError, ValueError):
    """The checkpoint is not a decoder refractor implements natively."""


@dataclass(frozen=True)
class MoeConfig:
    """The experts of a mixture-of-experts decoder (every layer's MLP is its router and experts).
    refractor's native model has no experts; the Megatron trainer reads them (``megatron/experts.py``)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # of each expert's gated MLP
    normalize_top_k: bool  # the top-k probabilities renormalized to sum to 1
    hf_block: str  # the HF layer's module holding the router (``gate``) and the experts
    hf_projections: tuple[str, str, str]  # each HF expert's (gate, up, down) linear names


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: dict[str, Any] = field(default_factory=dict)  # rope_type, rope_theta + the type's keys
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    moe: MoeConfig | None = None  # set by the Megatron trainer's reader only (``megatron/experts.py``)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """From a ``PretrainedConfig``, a ``config.json`` dict, or a ``ModelConfig`` (returned as is)."""
        if isinstance(hf_config, ModelConfig):
            return hf_config
        raw = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        arch = _architecture(raw)
        model_type, default_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        if raw.get("use_sliding_window") or (model_type == "llama" and raw.get("sliding_window")):
            raise UnsupportedModelError(
                f"{arch} with sliding-window attention is not implemented by refractor's native model; "
                "serve it with vLLM (inference_engine: vllm); "
                "the trainer falls back to HF AutoModelForCausalLM"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"{arch} with hidden_act={act!r} is not supported natively (only silu)"
            )
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", default_bias)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=qk_norm,
            rope=_rope_parameters(raw, arch),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )


def native_architecture(raw: dict[str, Any]) -> str | None:
    """The architecture of a ``config.json`` dict when refractor's native model implements it."""
    try:
        return _architecture(raw)
    except UnsupportedModelError:
        return None


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    if not archs and raw.get("model_type") in _ARCH_BY_MODEL_TYPE:
        return _ARCH_BY_MODEL_TYPE[raw["model_type"]]
    name = ", ".join(archs) or f"model_type={raw.get('model_type')!r}"
    raise UnsupportedModelError(
        f"architecture {name} is not implemented by refractor's native model "
        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); serve it with vLLM "
        "(inference_engine: vllm); the trainer falls back to HF AutoModelForCausalLM"
    )


def _rope_parameters(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.pop("type", None) or params.get("rope_type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{arch} uses rope_type={rope_type!r}, which refractor's native model does not implement "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)}); serve it with vLLM (inference_engine: vllm)"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"{arch} with partial_rotary_factor != 1 is not supported natively")
    return params
