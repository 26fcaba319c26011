"""Decoder building blocks of the Llama family, with Hugging Face parameter names.

Shapes are flat: activations are ``[T, hidden]`` for the T tokens of one forward (a packed
training row, or the prefill/decode tokens of an engine step); there is no batch dimension.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from refractor.models.attention import AttentionBackend
from refractor.models.config import ModelConfig
from refractor.models.ops import ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class FusedLinear(nn.Module):
    """Linears that read the same input, run as one GEMM: their weights (and biases) stacked on the
    output dim, in order.

    ``forward`` returns each part's output as a view of the one GEMM's output. ``part(name, kind)``
    is a row-slice view of the stacked parameter, sliced from the live parameter at each call (sleep
    mode moves the parameters after fusion), so a ``copy_`` into it writes the fused weight in place.
    """

    def __init__(self, linears: dict[str, nn.Linear]):
        super().__init__()
        first = next(iter(linears.values()))
        requires_grad = first.weight.requires_grad
        self.weight = nn.Parameter(
            torch.cat([linear.weight.detach() for linear in linears.values()]), requires_grad
        )
        if first.bias is None:
            self.register_parameter("bias", None)
        else:
            biases = [linear.bias.detach() for linear in linears.values()]
            self.bias = nn.Parameter(torch.cat(biases), requires_grad)
        self.split_sizes = [linear.out_features for linear in linears.values()]
        self.rows: dict[str, slice] = {}
        start = 0
        for name, size in zip(linears, self.split_sizes, strict=True):
            self.rows[name] = slice(start, start + size)
            start += size

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.split_sizes, dim=-1)

    def part(self, name: str, kind: str) -> torch.Tensor:
        """The rows of part ``name`` in the ``kind`` ("weight" or "bias") parameter."""
        return self.get_parameter(kind)[self.rows[name]]

    def named_parts(self) -> Iterator[tuple[str, torch.Tensor]]:
        """("<part>.<kind>", view) for every part, in the order of the unfused Linears' parameters."""
        for name in self.rows:
            for kind, _ in self.named_parameters(recurse=False):
                yield f"{name}.{kind}", self.part(name, kind)


def stacked_linear(x: torch.Tensor, linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """The outputs of ``linears`` (plain Linears that read the same ``x``) from one GEMM over their
    weights stacked on the output dim.

    The trainer's form of ``FusedLinear``: the parameters stay separate (HF names, FSDP2 shards, LoRA
    targets and checkpoints are untouched) and each forward concatenates the gathered weights, a copy
    of a few MB per layer, for one large GEMM in place of three small ones (q/k/v) or two (gate/up);
    autograd splits the weight gradient back into the parts."""
    weight = torch.cat([linear.weight for linear in linears])
    bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
    return F.linear(x, weight, bias).split([linear.out_features for linear in linears], dim=-1)


def _plain(*modules: nn.Module) -> bool:
    # a subclass (LoRA, float8 training linears) has its own forward, which stacking would bypass
    return all(type(m) is nn.Linear for m in modules)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h = config.hidden_size
        d = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        bias = config.attention_bias
        # set by fuse_projections (the engine); registered first so that a fused layer still lists
        # its parameters in the HF order
        self.register_module("qkv_proj", None)
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        if config.qk_norm:  # Qwen3: RMSNorm over each head's q and k, before rope
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.stack_projections = False  # stack_projections_if_plain(): q/k/v through stacked_linear

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBackend,
        layer_index: int,
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x)
        elif self.stack_projections:
            q, k, v = stacked_linear(x, (self.q_proj, self.k_proj, self.v_proj))
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = ops.rotary_qk(q, k, cos, sin)
        out = attention(q, k, v, layer_index)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Replace q_proj, k_proj and v_proj by one ``qkv_proj`` (idempotent)."""
        if self.qkv_proj is None:
            self.qkv_proj = FusedLinear({"q_proj": self.q_proj, "k_proj": self.k_proj, "v_proj": self.v_proj})
            del self.q_proj, self.k_proj, self.v_proj

    def stack_projections_if_plain(self) -> bool:
        """Run q/k/v as one GEMM over stacked weights when all three are plain Linears."""
        self.stack_projections = self.qkv_proj is None and _plain(self.q_proj, self.k_proj, self.v_proj)
        return self.stack_projections


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h = config.hidden_size
        i = config.intermediate_size
        bias = config.mlp_bias
        self.register_module("gate_up_proj", None)  # as SelfAttention.qkv_proj
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.stack_projections = False  # as SelfAttention.stack_projections, for gate/up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x)
        elif self.stack_projections:
            gate, up = stacked_linear(x, (self.gate_proj, self.up_proj))
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(ops.silu_mul(gate, up))

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Replace gate_proj and up_proj by one ``gate_up_proj`` (idempotent)."""
        if self.gate_up_proj is None:
            self.gate_up_proj = FusedLinear({"gate_proj": self.gate_proj, "up_proj": self.up_proj})
            del self.gate_proj, self.up_proj

    def stack_projections_if_plain(self) -> bool:
        """Run gate/up as one GEMM over stacked weights when both are plain Linears."""
        self.stack_projections = self.gate_up_proj is None and _plain(self.gate_proj, self.up_proj)
        return self.stack_projections


class DecoderLayer(nn.Module):
    """One pre-norm block; a separate module so FSDP2 and activation checkpointing wrap it alone."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.self_attn = SelfAttention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention, self.layer_index)
        return x + self.mlp(self.post_attention_layernorm(x))
