"""Runtime LoRA on a GPU: the adapter GEMMs run inside the decode CUDA graphs captured at load; two
adapter updates in a row land in the captured buffers, and each time the graphs generate what the
eager engine and HF transformers with the adapters merged (float32) generate, token for token."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_engine_lora import PROMPTS, adapter_tensors, buffer_addresses, hf_greedy, merged_hf, trained_lora

from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
CONFIG = EngineConfig(max_model_len=512, max_num_seqs=8, kv_cache_memory_gb=1.0, dtype="float32", lora_rank=4)


def _tokens(engine: LLMEngine) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]


def test_adapters_inside_cuda_graphs_generate_what_eager_and_the_merged_model_do(tiny_qwen2_path):
    graphs = LLMEngine.from_pretrained(tiny_qwen2_path, CONFIG)
    eager = LLMEngine.from_pretrained(tiny_qwen2_path, replace(CONFIG, enforce_eager=True))
    assert graphs.runner.graphs and not eager.runner.graphs
    addresses = buffer_addresses(graphs)
    for seed in (0, 1):  # the second update replaces adapters the graphs already ran with
        adapters = adapter_tensors(trained_lora(tiny_qwen2_path, seed=seed))
        graphs.update_weights(adapters, version=seed + 1)
        eager.update_weights(adapters, version=seed + 1)
        assert buffer_addresses(graphs) == addresses
        merged = merged_hf(tiny_qwen2_path, adapters).cuda()
        want = [hf_greedy(merged, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
        assert _tokens(graphs) == _tokens(eager) == want
