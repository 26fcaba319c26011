"""Test and benchmark helpers that build everything offline (tiny models, fixtures)."""

from refractor.testing.tiny_models import (
    QWEN25_05B_SHAPE,
    QWEN25_15B_SHAPE,
    TinyModelSpec,
    build_tiny_model,
    build_tokenizer,
    qwen25_shaped,
    tiny_llama,
    tiny_mixtral,
    tiny_qwen2,
    tiny_qwen3,
    tiny_qwen3_moe,
)

# the control token of servers that tests and benchmarks start (a real run makes a fresh one)
TEST_CONTROL_TOKEN = "refractor-test-control-token"

__all__ = [
    "TEST_CONTROL_TOKEN",
    "QWEN25_05B_SHAPE",
    "QWEN25_15B_SHAPE",
    "TinyModelSpec",
    "build_tiny_model",
    "build_tokenizer",
    "qwen25_shaped",
    "tiny_llama",
    "tiny_qwen2",
    "tiny_qwen3",
    "tiny_qwen3_moe",
    "tiny_mixtral",
]
