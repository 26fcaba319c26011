"""Prefix caching on a GPU (CUDA-graph decode, bf16 and fp32): a group that reuses its prompt's KV
samples the same tokens as one that recomputes it, and its log-probs stay as close to Hugging Face's
fp32 forward as the uncached engine's."""

from __future__ import annotations

import pytest
import torch

from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _run(path, dtype: str, caching: bool, prompt: list[int]):
    config = EngineConfig(
        max_model_len=1200,
        kv_cache_memory_gb=0.1,
        dtype=dtype,
        max_num_seqs=16,
        enable_prefix_caching=caching,
    )
    engine = LLMEngine.from_pretrained(path, config)
    params = SamplingParams(n=8, temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)
    [out] = engine.generate([prompt], params)
    stats = engine.stats()
    return out.outputs, stats.prompt_tokens_total - stats.prefix_cache_hits_total


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_group_reusing_its_prompt_matches_recomputing_it(tiny_qwen2_path, dtype):
    from transformers import AutoModelForCausalLM

    prompt = torch.randint(3, 500, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    cached, computed = _run(tiny_qwen2_path, dtype, True, prompt)
    plain, _ = _run(tiny_qwen2_path, dtype, False, prompt)
    assert computed < 1000 + 8 * 32
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.float32).cuda().eval()

    def deviation(outputs) -> float:
        worst = 0.0
        for o in outputs:
            ids = torch.tensor([prompt + o.token_ids], device="cuda")
            with torch.no_grad():
                logits = hf(ids).logits[0, len(prompt) - 1 : -1].double()
            ref = logits.log_softmax(-1).gather(1, torch.tensor(o.token_ids, device="cuda")[:, None])[:, 0]
            worst = max(
                worst, (torch.tensor(o.logprobs, device="cuda", dtype=torch.float64) - ref).abs().max().item()
            )
        return worst

    if dtype == "float32":
        assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
        assert deviation(cached) <= 1e-3
    else:  # bf16 rounding may flip a sampled token; the deviation from fp32 HF must not grow
        assert deviation(cached) <= max(2 * deviation(plain), 2e-2)
