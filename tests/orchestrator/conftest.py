"""Fixtures of the orchestrator tests; the test doubles themselves live in ``orch_fakes``."""

import pytest
from transformers import AutoTokenizer


@pytest.fixture(scope="session")
def tok(tiny_qwen2_path):
    return AutoTokenizer.from_pretrained(tiny_qwen2_path)
