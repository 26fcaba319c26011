"""The tiny checkpoints of the Megatron tests (``_models``), one per architecture."""

from __future__ import annotations

import pytest

from ._models import build


@pytest.fixture(scope="session", params=["qwen2", "llama", "qwen3"])
def tiny_model(request):
    """(architecture, checkpoint directory)."""
    return request.param, build(request.param)
