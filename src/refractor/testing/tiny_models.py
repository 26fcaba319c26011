"""Deterministic, offline tiny checkpoints for tests and benchmarks.

Each builder writes a normal Hugging Face directory (``config.json``, ``model.safetensors``,
tokenizer files with a ChatML chat template) that ``from_pretrained`` and vLLM load like any
downloaded model. Results are cached on disk (``$REFRACTOR_CACHE`` or ``~/.cache/refractor``),
keyed by a hash of the spec, and written atomically so concurrent test workers can share them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB_SIZE = 512
_BUILD_VERSION = 1  # bump to invalidate every cached artifact when the builders change

# A fixed corpus: chat-ish English, arithmetic and code, so the BPE merges are useful for the
# built-in tasks (countdown equations, math answers, short programs) and identical on every machine.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Using the numbers 3, 7, 25 and 50, create an equation that equals 100.",
    "<think> Let me try 50 + 25 + 3 * 7 = 96, not quite. 50 * 3 - 25 - 7 = 118. </think>",
    "<answer> (25 - 7 - 3) * 50 / 7 </answer> The answer is \\boxed{42}.",
    "def solve(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(solve(1, 2))\n",
    "import sys\nfor line in sys.stdin:\n    x = int(line)\n    print(x * x)\n",
    "You are a helpful assistant. Think step by step and put the final answer in a box.",
    "Guess the five letter word. Feedback: G = green, Y = yellow, X = gray. crane slate audio",
    "user assistant system tool call result error value number equals plus minus times",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 50 75 100 1000 + - * / = ( )",
    "What is the sum of the first ten positive integers? It is 55. Therefore x = 55.",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}</tool_call>',
]


@dataclass(frozen=True)
class TinyModelSpec:
    """What to build. ``arch`` is an HF ``model_type`` (qwen2, llama, qwen3)."""

    arch: str = "qwen2"
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    vocab_size: int | None = None  # None: the tokenizer's size rounded up to a multiple of 64
    torch_dtype: str = "float32"
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "v": _BUILD_VERSION}, sort_keys=True)
        return f"{self.arch}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def cache_root() -> Path:
    return Path(os.environ.get("REFRACTOR_CACHE", Path.home() / ".cache" / "refractor"))


def build_tokenizer(
    corpus: list[str] | None = None, vocab_size: int = TOKENIZER_VOCAB_SIZE, split_digits: bool = False
):
    """A byte-level BPE tokenizer trained on ``corpus`` (default: the fixed test corpus), with EOS/pad
    and a ChatML template. ``split_digits``: every digit is a token of its own (as in Qwen's and
    Llama's tokenizers), so a number reads the same wherever it stands and arithmetic works digit by
    digit."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS if corpus is None else corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _hf_config(spec: TinyModelSpec, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import AutoConfig

    kwargs: dict[str, Any] = dict(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tie_word_embeddings,
        vocab_size=vocab_size,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        rms_norm_eps=1e-6,
        torch_dtype=spec.torch_dtype,
    )
    if spec.rope_scaling is not None:
        kwargs["rope_scaling"] = dict(spec.rope_scaling)
    if spec.arch == "qwen2":
        kwargs["use_sliding_window"] = False
    kwargs.update(spec.extra)
    return AutoConfig.for_model(spec.arch, **kwargs)


def _build(spec: TinyModelSpec, out: Path, with_weights: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    vocab_size = spec.vocab_size or -(-len(tokenizer) // 64) * 64
    config = _hf_config(spec, vocab_size, eos_id, pad_id)
    tokenizer.save_pretrained(out)
    if not with_weights:
        config.save_pretrained(out)
        return
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.torch_dtype))
    # HF initializes norms to 1 and biases to 0; give them noise so parity tests exercise them.
    with torch.no_grad():
        gen = torch.Generator().manual_seed(spec.seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.1)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out, safe_serialization=True)


def build_tiny_model(spec: TinyModelSpec | None = None, *, with_weights: bool = True) -> Path:
    """Return the directory of the checkpoint described by ``spec``, building it once if needed."""
    spec = spec or TinyModelSpec()
    final = cache_root() / "models" / (spec.key() + ("" if with_weights else "-config"))
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=final.parent))
    try:
        _build(spec, tmp, with_weights)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race; its copy is identical
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# Named specs used across tests and benchmarks.
def tiny_qwen2(**overrides: Any) -> Path:
    return build_tiny_model(TinyModelSpec(arch="qwen2", **overrides))


def tiny_llama(**overrides: Any) -> Path:
    overrides.setdefault("tie_word_embeddings", False)
    overrides.setdefault(
        "rope_scaling",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    )
    overrides.setdefault("rope_theta", 500000.0)
    return build_tiny_model(TinyModelSpec(arch="llama", **overrides))


def tiny_qwen3(**overrides: Any) -> Path:
    return build_tiny_model(TinyModelSpec(arch="qwen3", **overrides))


QWEN25_05B_SHAPE = TinyModelSpec(
    arch="qwen2",
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    vocab_size=151936,
    torch_dtype="bfloat16",
)
QWEN25_15B_SHAPE = TinyModelSpec(
    arch="qwen2",
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    head_dim=128,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    vocab_size=151936,
    torch_dtype="bfloat16",
)
QWEN25_3B_SHAPE = replace(
    QWEN25_15B_SHAPE, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16
)
QWEN25_7B_SHAPE = TinyModelSpec(
    arch="qwen2",
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    head_dim=128,
    tie_word_embeddings=False,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    vocab_size=152064,
    torch_dtype="bfloat16",
)


def qwen25_shaped(size: str = "0.5b", *, with_weights: bool = True) -> Path:
    """A random-weight model with Qwen2.5-0.5B (1.5B, 3B, 7B) shapes, for GPU benchmarks.

    ``with_weights=False`` writes only config + tokenizer (cheap); benchmarks then initialize
    weights randomly on the device, which is far faster than writing ~1 GB of safetensors.
    """
    spec = {
        "0.5b": QWEN25_05B_SHAPE,
        "1.5b": QWEN25_15B_SHAPE,
        "3b": QWEN25_3B_SHAPE,
        "7b": QWEN25_7B_SHAPE,
    }[size.lower()]
    return build_tiny_model(spec, with_weights=with_weights)


def tiny_qwen3_moe(**overrides: Any) -> Path:
    """A Qwen3-MoE checkpoint: every layer's MLP is a router and ``num_experts`` experts (``extra`` sets
    num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob)."""
    extra = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}
    overrides["extra"] = {**extra, **overrides.get("extra", {})}
    return build_tiny_model(TinyModelSpec(arch="qwen3_moe", **overrides))


def tiny_mixtral(**overrides: Any) -> Path:
    """A Mixtral checkpoint (``intermediate_size`` is each expert's; ``extra`` sets num_local_experts,
    num_experts_per_tok)."""
    overrides["extra"] = {"num_local_experts": 4, "num_experts_per_tok": 2, **overrides.get("extra", {})}
    overrides.setdefault("tie_word_embeddings", False)
    return build_tiny_model(TinyModelSpec(arch="mixtral", **overrides))
