"""The tiny checkpoints of the Megatron tests (``_models``), one per architecture, and the one-rank
worlds the tests run in."""

from __future__ import annotations

import pytest

from ._cpu_forward import gloo_world, start_megatron, stop_megatron
from ._models import build


@pytest.fixture(scope="session", params=["qwen2", "llama", "qwen3"])
def tiny_model(request):
    """(architecture, checkpoint directory)."""
    return request.param, build(request.param)


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo process group for the module's tests."""
    with gloo_world():
        yield


@pytest.fixture(scope="module")
def one_rank_world(world):
    """The one-rank process group with Megatron-Core's parallel state of TP 1 x PP 1."""
    start_megatron(1, 1)
    yield
    stop_megatron()
