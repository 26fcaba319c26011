"""The Llama-family causal LM (Llama 3, Qwen2/2.5, Qwen3) shared by the trainer and the engine."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from refractor.models.attention import AttentionBackend
from refractor.models.config import ModelConfig
from refractor.models.layers import DecoderLayer, FusedLinear, RMSNorm
from refractor.models.rope import RotaryEmbedding


class DecoderModel(nn.Module):
    """HF's ``model.`` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)  # a plain object: no buffers, nothing in the state dict

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attention)
        return self.norm(x)


class CausalLM(nn.Module):
    """``forward`` returns the final-norm hidden states [T, H]; logits are a separate, explicit step.

    Keeping the LM head out of ``forward`` lets the trainer compute log-probs in vocab chunks
    (never the full [T, V] fp32 logits) and lets the engine project only the last token of each
    prefilled sequence.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._register_load_state_dict_pre_hook(self._drop_tied_lm_head)

    def _drop_tied_lm_head(self, state_dict, prefix, *args) -> None:
        # HF state dicts of tied models may carry ``lm_head.weight`` (the same tensor as the
        # embedding); there is no separate parameter to load it into, so it is ignored (as vLLM does).
        if self.lm_head is None:
            state_dict.pop(prefix + "lm_head.weight", None)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        """input_ids, position_ids: [T] int64 -> hidden states [T, hidden_size]."""
        return self.model(input_ids, position_ids, attention)

    def lm_head_weight(self) -> torch.Tensor:
        """The [V, H] output projection (the embedding matrix when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight())

    def fuse_projections(self) -> None:
        """Run q/k/v as one GEMM and gate/up as one in every layer (the engine's decode speed).

        Engine only: the trainer and checkpoints keep the unfused HF layout, and HF names still
        address each part (``named_hf_parameters``, ``get_parameter_by_hf_name``). Layer by layer,
        so at most one layer's projections are held twice.
        """
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def stack_projections(self) -> int:
        """Run q/k/v and gate/up each as one GEMM over weights concatenated at every forward (the
        trainer: parameters stay separate; ``layers.stacked_linear``), where the projections are plain
        Linears (not LoRA or float8 ones); returns how many groups are stacked."""
        return sum(
            layer.self_attn.stack_projections_if_plain() + layer.mlp.stack_projections_if_plain()
            for layer in self.model.layers
        )

    def named_hf_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter by its HF name, in the unfused order; a fused part is a row-slice view."""
        for module_name, module in self.named_modules():
            if isinstance(module, FusedLinear):
                parent = module_name.rpartition(".")[0]
                for name, view in module.named_parts():
                    yield f"{parent}.{name}", view
            else:
                for kind, param in module.named_parameters(recurse=False):
                    yield f"{module_name}.{kind}", param

    def hf_state_dict_names(self) -> list[str]:
        """Every HF checkpoint name this model reads (``lm_head.weight`` only when untied)."""
        return [name for name, _ in self.named_hf_parameters()]

    def get_parameter_by_hf_name(self, name: str) -> torch.Tensor:
        """The parameter an HF checkpoint name refers to; raises AttributeError for an unknown name.

        ``lm_head.weight`` aliases the embedding when tied. On a fused model a q/k/v or gate/up name
        gives a row-slice view of the fused parameter: a ``copy_`` into it writes that parameter.
        """
        if name == "lm_head.weight" and self.lm_head is None:
            return self.model.embed_tokens.weight
        module_path, _, kind = name.rpartition(".")
        parent_path, _, part = module_path.rpartition(".")
        for child in self.get_submodule(parent_path).children():
            if isinstance(child, FusedLinear) and part in child.rows:
                return child.part(part, kind)
        return self.get_parameter(name)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random init (normal for matrices, zeros for biases, ones for norms), e.g. after ``to_empty``."""
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)
