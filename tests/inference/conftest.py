"""Fixtures of the inference tests: ONE vLLM CPU server per test session (starting one is slow), with
its request spans exported to an OTLP receiver, the trainer-side sender bound to it, and
transformers references for log-prob parity."""

from __future__ import annotations

import pytest
import torch

from refractor.testing import TEST_CONTROL_TOKEN

VLLM_SERVED_NAME = "tiny"


@pytest.fixture(params=[False, True], ids=["host-waits", "host-ahead"])
def async_scheduling(request) -> bool:
    """The engine's ``async_scheduling``: engine tests that take it run with the host waiting for each
    decode step's tokens, and with the host launching the next step before recording them."""
    return request.param


@pytest.fixture(scope="session")
def tiny_qwen2_seed1_path():
    """A second checkpoint of the same (tied-embedding) architecture: different weights."""
    from refractor.testing import TinyModelSpec, build_tiny_model

    return build_tiny_model(TinyModelSpec(seed=1))


@pytest.fixture(scope="session")
def otlp_receiver():
    """The trace receiver the session's vLLM server exports its request spans to (as in a run)."""
    from refractor.telemetry.otlp import OtlpTraceReceiver

    receiver = OtlpTraceReceiver("127.0.0.1", 0)
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def vllm_server(tiny_qwen2_path, otlp_receiver):
    pytest.importorskip("vllm")
    from refractor.inference.vllm.launcher import VllmServerSettings, start_vllm_server

    settings = VllmServerSettings(
        dtype="float32",  # exact parity with transformers (bf16 would differ by ~1e-2)
        max_model_len=512,
        kv_cache_memory_gb=0.25,
        max_num_seqs=16,
        served_model_name=VLLM_SERVED_NAME,
        otlp_traces_endpoint=otlp_receiver.endpoint,
        startup_timeout_s=300,
        extra_env={"VLLM_CPU_CI_ENV": "1"},
    )  # CI env: skip the warm-up pass
    server = start_vllm_server(tiny_qwen2_path, settings=settings, control_token=TEST_CONTROL_TOKEN)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_sender(vllm_server):
    from refractor.weight_sync import ServerRef, WeightSender, WeightSyncSettings

    sender = WeightSender(
        [ServerRef("vllm-0", vllm_server.url)],
        WeightSyncSettings(control_token=TEST_CONTROL_TOKEN, init_timeout_s=60, timeout_s=60),
    )
    yield sender
    sender.close()


def load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_token_logprobs(
    model, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """log p(completion[i] | prompt + completion[:i]) of the temperature-scaled distribution (float64)."""
    logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.fixture(scope="session")
def hf_token_logprobs():
    return _hf_token_logprobs


@torch.no_grad()
def _stale_kv_logprobs(old, new, prompt: list[int], completion: list[int], switch: int) -> torch.Tensor:
    """log p(completion[i]), i >= switch, when ``old`` wrote the KV of prompt + completion[:switch - 1] and
    ``new`` runs from there on: an in-flight request that kept its KV across a weight update (the token
    sampled at step i is fed, and cached, at step i + 1, so completion[switch - 1] is the first token ``new``
    caches)."""
    cache = old(torch.tensor([prompt + completion[: switch - 1]]), use_cache=True).past_key_values
    logits = (
        new(torch.tensor([completion[switch - 1 : -1]]), past_key_values=cache, use_cache=True)
        .logits[0]
        .double()
    )
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion[switch:])[:, None])[:, 0]


@pytest.fixture(scope="session")
def stale_kv_logprobs():
    return _stale_kv_logprobs


@pytest.fixture(scope="session")
def vllm_model_name():
    return VLLM_SERVED_NAME


@pytest.fixture(scope="session")
def hf_models(tiny_qwen2_path, tiny_qwen2_seed1_path):
    """{seed: transformers model} of the two tiny checkpoints."""
    return {0: load_hf(tiny_qwen2_path), 1: load_hf(tiny_qwen2_seed1_path)}
