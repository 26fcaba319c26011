"""A real native server (``create_app`` around an ``AsyncLLMEngine``) served by uvicorn from a thread of
the test process, so a test can also act as the trainer's side of a weight-transfer group. Imported by
the tests of this folder as ``native_thread_server``."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn
from transformers import AutoTokenizer

from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams
from refractor.inference.engine.async_engine import AsyncLLMEngine
from refractor.inference.process import free_port
from refractor.inference.server import create_app
from refractor.testing import TEST_CONTROL_TOKEN
from refractor.weight_sync.control_plane import ServerRef

PROMPT = list(range(3, 30))
ENGINE_CONFIG = EngineConfig(
    max_model_len=512,
    max_num_seqs=4,
    kv_cache_memory_gb=0.02,
    dtype="float32",
    device="cpu",
    enforce_eager=True,
)


class ThreadServer:
    """A native engine behind uvicorn, served from a thread of the test process."""

    def __init__(self, name: str, model_path, config: EngineConfig = ENGINE_CONFIG):
        self.name = name
        self.engine = AsyncLLMEngine(LLMEngine.from_pretrained(model_path, config))
        app = create_app(
            self.engine, AutoTokenizer.from_pretrained(model_path), name, control_token=TEST_CONTROL_TOKEN
        )
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    @property
    def ref(self) -> ServerRef:
        return ServerRef(self.name, self.url)

    def generate(self, n: int = 2, max_tokens: int = 12, seed: int = 0):
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=seed)
        return asyncio.run(self.engine.generate(PROMPT, params)).outputs

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()
