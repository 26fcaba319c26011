"""Trainer -> native server weight sync: the trainer gathers its buckets while the server still generates.

Real pieces only: the trainer's bucket export, ``WeightSender`` (gloo), and the native server
(``create_app`` around an ``AsyncLLMEngine``, served by uvicorn from a thread). The bucket stream
is observed as the sender consumes it: at each bucket the test asks whether the server is paused
and sends it a real completion request, which only finishes if the server is generating.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
import uvicorn
from transformers import AutoTokenizer

from refractor.inference.engine import EngineConfig, LLMEngine
from refractor.inference.engine.async_engine import AsyncLLMEngine
from refractor.inference.server import create_app
from refractor.inference.vllm.launcher import free_port
from refractor.testing import TEST_CONTROL_TOKEN
from refractor.trainer import Trainer
from refractor.weight_sync.control_plane import ServerRef
from refractor.weight_sync.sender import WeightSender
from refractor.weight_sync.settings import WeightSyncSettings
from trainer._helpers import make_samples, make_settings, pack, quiet_env

quiet_env()
BUCKET_MB = 0.25


class NativeServer:
    def __init__(self, model_path):
        config = EngineConfig(
            max_model_len=256,
            max_num_seqs=4,
            kv_cache_memory_gb=0.01,
            dtype="float32",
            device="cpu",
            enforce_eager=True,
        )
        self.engine = AsyncLLMEngine(LLMEngine.from_pretrained(model_path, config))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        app = create_app(
            self.engine, AutoTokenizer.from_pretrained(model_path), "tiny", control_token=TEST_CONTROL_TOKEN
        )
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def complete(self, timeout_s: float = 30.0) -> int:
        """Generated tokens of one real completion request (raises if the server cannot generate in time)."""
        body = {
            "model": "tiny",
            "prompt": list(range(3, 20)),
            "max_tokens": 3,
            "temperature": 1.0,
            "ignore_eos": True,
        }
        reply = httpx.post(f"{self.url}/v1/completions", json=body, timeout=timeout_s)
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()


@pytest.fixture(scope="module")
def server(tiny_qwen2_path):
    s = NativeServer(tiny_qwen2_path)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def trainer(tiny_qwen2_path):
    return Trainer(make_settings(tiny_qwen2_path))


def observed(buckets, server: NativeServer, log: list[dict]):
    """Pass the trainer's buckets through, recording the server's state as each one is gathered."""
    for bucket in buckets:
        paused = server.engine.is_paused
        tokens = None if paused else server.complete()  # a paused server would hold the request
        log.append({"paused": paused, "tokens": tokens})
        yield bucket


@pytest.mark.parametrize(("budget_buckets", "first_paused_gather"), [(100, None), (0, 0), (2, 3)])
def test_buckets_are_gathered_before_the_pause_within_the_budget(
    server, trainer, budget_buckets, first_paused_gather
):
    """Budget of 100 buckets: every gather happens while the server generates; 0: every gather
    happens during the pause; 2 buckets (each a little under the bucket size): the
    third gather crosses the budget and is kept, the fourth happens during the pause."""
    bucket_bytes = int(BUCKET_MB * 2**20)
    sender = WeightSender(
        [ServerRef("native-0", server.url)],
        WeightSyncSettings(
            control_token=TEST_CONTROL_TOKEN,
            init_timeout_s=30,
            timeout_s=30,
            gather_before_pause_bytes=budget_buckets * bucket_bytes,
        ),
    )
    try:
        log: list[dict] = []
        result = sender.push(observed(trainer.export_weight_buckets(BUCKET_MB), server, log), version=7)
    finally:
        sender.close()
    paused = [entry["paused"] for entry in log]
    assert len(paused) > 4, paused  # the tiny model spans several buckets
    first = paused.index(True) if True in paused else None
    assert first == first_paused_gather, paused
    assert all(paused[first:]) if first is not None else True  # once paused, paused to the end
    assert all(entry["tokens"] == 3 for entry in log if not entry["paused"])  # generation went on
    assert not server.engine.is_paused and server.complete() == 3  # resumed
    assert result.version == 7 and result.stats.tensors == len(list(trainer.model.parameters()))
    assert 0 < result.paused_seconds < result.trainer_seconds
    ahead = {None: result.stats.bytes, 0: 0}.get(first_paused_gather)
    if ahead is None:  # partial budget
        assert 2 * bucket_bytes <= result.gathered_ahead_bytes < result.stats.bytes
    else:
        assert result.gathered_ahead_bytes == ahead


def test_weights_gathered_ahead_are_the_ones_served(server, trainer):
    trainer.train_step(pack(make_samples(n=3)))  # the trainer's weights now differ from the server's
    expected = {name: t.clone() for bucket in trainer.export_weight_buckets(BUCKET_MB) for name, t in bucket}
    name0 = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(dict(server.engine.named_parameters())[name0], expected[name0])
    sender = WeightSender(
        [ServerRef("native-0", server.url)],
        WeightSyncSettings(
            control_token=TEST_CONTROL_TOKEN,
            init_timeout_s=30,
            timeout_s=30,
            gather_before_pause_bytes=1 << 30,
        ),
    )
    try:
        result = sender.push(trainer.export_weight_buckets(BUCKET_MB), version=8)
    finally:
        sender.close()
    assert result.gathered_ahead_bytes == result.stats.bytes
    live = dict(server.engine.named_parameters())
    for name, t in expected.items():
        assert torch.equal(live[name], t), name
