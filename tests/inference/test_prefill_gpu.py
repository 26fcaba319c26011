"""Prefill on a GPU in bf16 (GPU only): sequences without a cached prefix go to the varlen
FlashAttention kernel as they lie (no padding, no per-shape plan), and the engine's log-probs stay as
close to Hugging Face's fp32 forward as with padded SDPA."""

from __future__ import annotations

import pytest
import torch

from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_varlen_prefill_matches_hf_as_padded_sdpa_does(tiny_qwen2_path):
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (1, 7, 64, 200, 333)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    config = EngineConfig(max_model_len=512, kv_cache_memory_gb=0.1, dtype="bfloat16", max_num_seqs=8)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.float32).cuda().eval()

    def deviation(varlen: bool) -> float:
        engine = LLMEngine.from_pretrained(tiny_qwen2_path, config)
        assert engine.runner.varlen_prefill  # this GPU and torch run it
        engine.runner.varlen_prefill = varlen
        worst = 0.0
        for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
            token = out.outputs[0].token_ids[0]
            with torch.no_grad():
                logits = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].double()
            worst = max(worst, abs(out.outputs[0].logprobs[0] - logits.log_softmax(-1)[token].item()))
        return worst

    padded = deviation(False)
    assert deviation(True) <= max(2 * padded, 2e-2)
