"""Fused projections in the native engine (one GEMM for q/k/v, one for gate/up): the same tokens and
log-probs as the unfused engine, the HF names of the unfused model (row views of the fused weights),
weight updates by HF name that land in the fused weights, and sleep mode on top."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams
from refractor.models import iter_safetensors, load_model

CONFIG = EngineConfig(
    max_model_len=256, kv_cache_memory_gb=0.02, block_size=16, dtype="float32", fuse_projections=True
)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [list(range(3, 30)), list(range(40, 47)), list(range(100, 160)), [7, 8]]


def _engines(path, config: EngineConfig = CONFIG) -> tuple[LLMEngine, LLMEngine]:
    """(fused, unfused) engines of one checkpoint."""
    fused = LLMEngine.from_pretrained(path, config)
    unfused = LLMEngine.from_pretrained(path, replace(config, fuse_projections=False))
    return fused, unfused


def _assert_same_generation(fused: LLMEngine, unfused: LLMEngine, tolerance: float = 1e-5) -> None:
    for a, b in zip(fused.generate(PROMPTS, GREEDY), unfused.generate(PROMPTS, GREEDY), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        diff = torch.tensor(a.outputs[0].logprobs) - torch.tensor(b.outputs[0].logprobs)
        assert diff.abs().max().item() <= tolerance


@pytest.mark.parametrize("fixture", ["tiny_qwen2_path", "tiny_llama_path", "tiny_qwen3_path"])
def test_fused_engine_generates_what_the_unfused_one_does(fixture, request):
    """Qwen2 (q/k/v biases), Llama (no biases), Qwen3 (q/k norms); all three GQA."""
    fused, unfused = _engines(request.getfixturevalue(fixture))
    attention = fused.model.model.layers[0].self_attn
    assert attention.num_kv_heads < attention.num_heads
    assert attention.qkv_proj is not None and fused.model.model.layers[0].mlp.gate_up_proj is not None
    assert unfused.model.model.layers[0].self_attn.qkv_proj is None
    _assert_same_generation(fused, unfused)


@pytest.mark.parametrize("fixture", ["tiny_qwen2_path", "tiny_llama_path"])
def test_named_parameters_are_the_hf_names_as_views_of_the_fused_weights(fixture, request):
    path = request.getfixturevalue(fixture)
    fused, _ = _engines(path)
    plain = load_model(path)
    names = [name for name, _ in plain.named_parameters()]
    assert [name for name, _ in fused.named_parameters()] == names
    assert fused.model.hf_state_dict_names() == names
    for name, tensor in fused.named_parameters():
        assert torch.equal(tensor, plain.get_parameter(name)), name
    attention = fused.model.model.layers[1].self_attn
    k = fused.model.get_parameter_by_hf_name("model.layers.1.self_attn.k_proj.weight")
    assert k.untyped_storage().data_ptr() == attention.qkv_proj.weight.untyped_storage().data_ptr()
    assert torch.equal(k, attention.qkv_proj.weight[attention.num_heads * attention.head_dim :][: k.shape[0]])
    with pytest.raises(AttributeError):
        fused.model.get_parameter_by_hf_name("model.layers.1.self_attn.qkv_proj.weight.x")


def _perturbation(engine: LLMEngine) -> list[tuple[str, torch.Tensor]]:
    """New values for every fused part (weights and biases) of layer 0 and one unfused weight."""
    gen = torch.Generator().manual_seed(5)
    parts = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj")
    return [
        (name, tensor + 0.05 * torch.randn(tensor.shape, generator=gen))
        for name, tensor in engine.named_parameters()
        if name.startswith("model.layers.0.") and name.split(".")[-2] in parts
    ]


@pytest.mark.parametrize("fixture", ["tiny_qwen2_path", "tiny_llama_path"])
def test_an_update_by_hf_name_lands_in_the_fused_weights(fixture, request):
    fused, unfused = _engines(request.getfixturevalue(fixture))
    update = _perturbation(unfused)
    assert any(name.endswith("k_proj.bias") for name, _ in update) == (fixture == "tiny_qwen2_path")
    before = [p.data_ptr() for p in fused.model.parameters()]
    tokens_before = [o.outputs[0].token_ids for o in fused.generate(PROMPTS, GREEDY)]
    assert fused.update_weights(update, version=1) == unfused.update_weights(update, version=1) == len(update)
    assert [p.data_ptr() for p in fused.model.parameters()] == before  # written in place
    live = dict(fused.named_parameters())
    for name, tensor in update:
        assert torch.equal(live[name], tensor), name
    outputs = fused.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] != tokens_before  # the update changed the model
    _assert_same_generation(fused, unfused)


def test_sleep_mode_moves_the_fused_weights_and_updates_reach_them(tiny_qwen2_path, tiny_qwen2_seed1_path):
    config = replace(CONFIG, device="cpu", enable_sleep_mode=True)
    engine = LLMEngine.from_pretrained(tiny_qwen2_path, config)
    arena = engine.memory.weights
    assert {id(p) for p in arena.params} == {id(p) for p in engine.model.parameters()}
    start = arena.memory.tensor.data_ptr()
    end = start + arena.memory.nbytes
    assert all(start <= t.data_ptr() < end for _, t in engine.named_parameters())  # views into the arena
    expected = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]
    other = LLMEngine.from_pretrained(tiny_qwen2_seed1_path, replace(CONFIG, fuse_projections=False))
    expected_other = [o.outputs[0].token_ids for o in other.generate(PROMPTS, GREEDY)]
    engine.sleep(level=1)
    engine.update_weights(iter_safetensors(tiny_qwen2_seed1_path))  # into the host copy, by HF name
    engine.wake_up()
    assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)] == expected_other
    engine.sleep(level=2)
    engine.wake_up(["weights"])
    engine.update_weights(iter_safetensors(tiny_qwen2_path))
    engine.wake_up(["kv_cache"])
    assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)] == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fixture", ["tiny_qwen2_path", "tiny_llama_path"])
def test_fused_engine_on_cuda_graphs_generates_what_the_unfused_one_does(fixture, request):
    config = replace(CONFIG, max_num_seqs=8, device="cuda")
    fused, unfused = _engines(request.getfixturevalue(fixture), config)
    assert fused.runner.graphs and unfused.runner.graphs
    _assert_same_generation(fused, unfused, tolerance=1e-4)  # other GEMM shapes, other cuBLAS kernels
