"""Split-KV decode attention in the engine (GPU only): once contexts are long and the batch small,
decode steps replay the split graphs, and greedy tokens and log-probs still match Hugging Face."""

from __future__ import annotations

import pytest
import torch

from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams
from refractor.inference.engine.attention import SPLIT_KV_MIN_CONTEXT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_long_contexts_decode_with_split_kv_as_hf_does(tiny_qwen2_path):
    from transformers import AutoModelForCausalLM

    config = EngineConfig(
        max_model_len=SPLIT_KV_MIN_CONTEXT + 256, kv_cache_memory_gb=0.2, dtype="float32", max_num_seqs=8
    )
    engine = LLMEngine.from_pretrained(tiny_qwen2_path, config)
    runner = engine.runner
    assert 2 in runner.split_graphs  # the batch below replays a split graph
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 500, (SPLIT_KV_MIN_CONTEXT + 40 * i,), generator=gen).tolist() for i in range(2)
    ]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.float32).cuda().eval()
    for prompt, out in zip(prompts, outs, strict=True):
        choice = out.outputs[0]
        ids = torch.tensor([prompt + choice.token_ids], device="cuda")
        with torch.no_grad():
            logits = hf(ids).logits[0, len(prompt) - 1 : -1].double()
        assert logits.argmax(-1).tolist() == choice.token_ids
        ref = logits.log_softmax(-1).gather(1, torch.tensor(choice.token_ids, device="cuda")[:, None])[:, 0]
        assert (torch.tensor(choice.logprobs, device="cuda", dtype=torch.float64) - ref).abs().max() <= 1e-3
