"""Sleep mode on a GPU: the driver's free memory grows by the KV cache and the weights, the addresses
the decode CUDA graphs captured stay valid, and generation after a wake equals generation before the
sleep token for token (greedy), at both levels."""

from __future__ import annotations

import pytest
import torch

from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams
from refractor.models import iter_safetensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GiB = 1 << 30
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPTS = [list(range(3, 30)), list(range(40, 47)), list(range(100, 160)), list(range(7, 9))]


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_memory_and_the_graphs_survive_the_wake(tiny_qwen2_path, level):
    config = EngineConfig(max_model_len=512, max_num_seqs=8, kv_cache_memory_gb=1.0, dtype="float32")
    engine = LLMEngine.from_pretrained(
        tiny_qwen2_path, EngineConfig(**{**vars(config), "enable_sleep_mode": True})
    )
    assert engine.runner.graphs, "decode runs on CUDA graphs here"
    reference = LLMEngine.from_pretrained(tiny_qwen2_path, config)
    expected = _tokens(reference.generate(PROMPTS, GREEDY))
    del reference
    torch.cuda.empty_cache()
    assert _tokens(engine.generate(PROMPTS, GREEDY)) == expected
    addresses = [engine.runner.kv_cache.data_ptr()] + [p.data_ptr() for p in engine.model.parameters()]
    held = engine.runner.kv_memory.nbytes + engine.memory.weights.memory.nbytes
    awake = _free()
    engine.sleep(level)
    freed = _free() - awake
    assert freed >= 0.99 * held, f"freed {freed / GiB:.3f} GiB of {held / GiB:.3f}"
    engine.wake_up(["weights"])
    if level == 2:  # discarded: the update refills them
        engine.update_weights(iter_safetensors(tiny_qwen2_path))
    engine.wake_up(["kv_cache"])
    assert awake - _free() <= 0.01 * held + (64 << 20)  # all taken back, nothing more
    assert [engine.runner.kv_cache.data_ptr()] + [
        p.data_ptr() for p in engine.model.parameters()
    ] == addresses
    for _ in range(2):  # and again, with another sleep in between
        assert _tokens(engine.generate(PROMPTS, GREEDY)) == expected
        engine.sleep(1)
        engine.wake_up()
