"""Shared fixtures: tiny offline models, marker handling, and a quiet, deterministic torch."""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool)")
    skip_vllm = pytest.mark.skip(reason="vLLM is not installed")
    has_cuda = _has_cuda()
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(skip_vllm)


@pytest.fixture(scope="session")
def tiny_qwen2_path():
    from refractor.testing import tiny_qwen2

    return tiny_qwen2()


@pytest.fixture(scope="session")
def tiny_llama_path():
    from refractor.testing import tiny_llama

    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_qwen3_path():
    from refractor.testing import tiny_qwen3

    return tiny_qwen3()


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory):
    """The README's quick start, 3 steps on CPU (asynchronous, zero-advantage groups discarded,
    metrics scraped every 0.5 s), run once for every test that only reads what a run leaves
    behind. Returns its run directory (``runs/quick``); tests must not write to it."""
    from pathlib import Path

    from refractor.config import load_config
    from refractor.train import run_training

    root = Path(__file__).resolve().parents[1]
    quickstart = root / "configs" / "examples" / "quickstart.yaml"
    os.environ.setdefault("REFRACTOR_ENV_PATH", str(root / "environments"))
    overrides = {
        "run_dir": str(tmp_path_factory.mktemp("quickstart") / "runs"),
        "run_name": "quick",
        "number_of_steps": 3,
        "ray_address": "",
        "max_async_rollout": 1,
        "discard_group_zero_advantage": True,
        "metrics_logger_interval_seconds": 0.5,
    }
    return run_training(load_config(quickstart, overrides), quiet=True, config_path=quickstart)
