"""Runtime LoRA in the native engine (``lora_sync: adapter``): adapters written into the engine's
buffers generate, token for token, what HF transformers generates with the adapters merged into its
weights (``W + scale B A`` in float64), fused projections or not, on every projection or some, with
or without an embedding trained in full beside them (``lora_modules_to_save``); the buffers keep
their addresses (CUDA graphs captured at load stay valid); without LoRA the engine runs its plain
projections; adapters that do not fit are refused naming both shapes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams
from refractor.inference.engine.lora import AdaptedFusedLinear, AdaptedLinear
from refractor.models import load_model
from refractor.models.lora import (
    ADAPTER_SCALE_NAME,
    ALL_PROJECTIONS,
    LoraSettings,
    add_lora,
    is_adapter_update_name,
)
from refractor.weight_sync.gather import iter_weight_buckets

RANK = 4
ALPHA = 8.0
CONFIG = EngineConfig(
    max_model_len=256, kv_cache_memory_gb=0.02, block_size=16, dtype="float32", device="cpu"
)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [list(range(3, 30)), [5, 17, 99, 240, 7, 300], list(range(100, 140, 3))]
SUBSET = ("q_proj", "v_proj", "down_proj")  # a fused part with and one without an adapter, a plain one


def trained_lora(path, targets=ALL_PROJECTIONS, rank: int = RANK, seed: int = 0, saved: tuple[str, ...] = ()):
    """The shared model with adapters as the trainer holds them (PEFT names), B moved away from zero
    far enough that the adapted model generates other tokens than the base; the modules of ``saved``
    (``lora_modules_to_save``) moved too."""
    model = load_model(path, dtype=torch.float32, device="cpu")
    settings = LoraSettings(
        lora_rank=rank, lora_alpha=ALPHA, lora_target_modules=targets, lora_modules_to_save=saved
    )
    add_lora(model, settings, torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator))
            elif p.requires_grad and ".lora_A." not in name:
                p.add_(torch.randn(p.shape, generator=generator) * p.std())
    return model


def adapter_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """What an adapter push carries (the trainer's export): every trained tensor, then the scale."""
    buckets = iter_weight_buckets(model, 1 << 30, torch.float32, adapters=True)
    return [(name, t.clone()) for bucket in buckets for name, t in bucket]


def load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def merged_hf(path, adapters: list[tuple[str, torch.Tensor]]):
    """HF transformers' model with every adapter merged, W + scale B A computed in float64, and the
    weights trained in full copied in."""
    hf = load_hf(path)
    tensors = dict(adapters)
    scale = float(tensors.pop(ADAPTER_SCALE_NAME))
    for name, a in tensors.items():
        if not is_adapter_update_name(name):
            hf.get_parameter(name).copy_(a)
        elif ".lora_A." in name:
            stem = name.removesuffix(".lora_A.weight")
            b = tensors[f"{stem}.lora_B.weight"]
            weight = hf.get_parameter(f"{stem}.weight")
            weight.copy_((weight.double() + scale * b.double() @ a.double()).float())
    return hf


@torch.no_grad()
def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids], device=model.device)).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def buffer_addresses(engine: LLMEngine) -> dict[str, int]:
    return {name: b.data_ptr() for name, b in engine.model.named_buffers()}


@pytest.mark.parametrize(
    ("fuse", "targets", "saved"),
    [(True, ALL_PROJECTIONS, ()), (True, SUBSET, ()), (False, SUBSET, ()), (True, SUBSET, ("embed_tokens",))],
)
def test_runtime_adapters_generate_what_the_merged_model_does(
    tiny_qwen2_path, hf_token_logprobs, fuse, targets, saved
):
    config = replace(CONFIG, fuse_projections=fuse, lora_rank=RANK, lora_target_modules=targets)
    engine = LLMEngine.from_pretrained(tiny_qwen2_path, config)
    lora = trained_lora(tiny_qwen2_path, targets, saved=saved)
    adapters = adapter_tensors(lora)
    whole = [name for name, _ in adapters if not is_adapter_update_name(name)]
    assert whole == [f"model.{name}.weight" for name in saved]  # the tied head is the embedding
    assert sorted(engine.update_names(adapters=True)) == sorted(n for n, _ in adapters if n not in whole)
    before = buffer_addresses(engine)
    assert before and adapters[-1] == (ADAPTER_SCALE_NAME, torch.tensor([ALPHA / RANK]))

    assert engine.update_weights(adapters, version=1) == len(adapters) - 1
    assert buffer_addresses(engine) == before  # written in place: captured graphs read the new values
    merged = merged_hf(tiny_qwen2_path, adapters)
    base = load_hf(tiny_qwen2_path)
    outputs = [o.outputs[0] for o in engine.generate(PROMPTS, GREEDY)]
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == hf_greedy(merged, prompt, GREEDY.max_tokens)
        error = torch.tensor(out.logprobs, dtype=torch.float64) - hf_token_logprobs(
            merged, prompt, out.token_ids
        )
        assert error.abs().max() < 1e-4
    assert any(
        out.token_ids != hf_greedy(base, p, GREEDY.max_tokens)
        for p, out in zip(PROMPTS, outputs, strict=True)
    )

    # the merged push (lora_sync: merged) into an engine without adapters generates the same tokens
    plain = LLMEngine.from_pretrained(tiny_qwen2_path, replace(CONFIG, fuse_projections=fuse))
    plain.update_weights(
        [pair for bucket in iter_weight_buckets(lora, 1 << 30, torch.float32) for pair in bucket]
    )
    assert [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)] == [o.token_ids for o in outputs]


def test_without_lora_the_projections_are_plain_and_a_fresh_adapter_changes_nothing(tiny_qwen2_path):
    plain = LLMEngine.from_pretrained(tiny_qwen2_path, CONFIG)
    adapted = LLMEngine.from_pretrained(tiny_qwen2_path, replace(CONFIG, lora_rank=RANK))
    kinds = (AdaptedLinear, AdaptedFusedLinear)
    assert not any(isinstance(m, kinds) for m in plain.model.modules()) and not list(plain.model.buffers())
    assert (
        sum(isinstance(m, kinds) for m in adapted.model.modules()) == 4 * plain.model.config.num_hidden_layers
    )
    assert plain.update_names(adapters=True) == [] and plain.update_names(adapters=False)
    # B starts at zero: the engine serves the base, exactly, until the first adapter update
    for a, b in zip(plain.generate(PROMPTS, GREEDY), adapted.generate(PROMPTS, GREEDY), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_adapters_that_do_not_fit_are_refused_naming_both(tiny_qwen2_path):
    engine = LLMEngine.from_pretrained(
        tiny_qwen2_path, replace(CONFIG, lora_rank=RANK, lora_target_modules=SUBSET)
    )
    mine = "rank 4 on q_proj, v_proj, down_proj"
    wrong_rank = adapter_tensors(trained_lora(tiny_qwen2_path, SUBSET, rank=2))
    with pytest.raises(
        ValueError,
        match=rf"adapters \(rank 2 on q_proj, v_proj, down_proj\) do not fit this server's .* \({mine}\)",
    ):
        engine.update_weights(wrong_rank, version=1)
    wrong_targets = adapter_tensors(trained_lora(tiny_qwen2_path, ("q_proj", "k_proj")))
    with pytest.raises(ValueError, match=rf"\(rank 4 on q_proj, k_proj\) do not fit .* \({mine}\)"):
        engine.update_weights(wrong_targets, version=1)
    good = adapter_tensors(trained_lora(tiny_qwen2_path, SUBSET))
    with pytest.raises(ValueError, match="carries its scale as one 'lora.scale'"):
        engine.update_weights(good[:-1], version=1)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(64,\), expected \(128,\)"):
        engine.update_weights([*good, ("model.norm.weight", torch.ones(64))], version=1)
    no_lora = LLMEngine.from_pretrained(tiny_qwen2_path, CONFIG)
    with pytest.raises(ValueError, match=rf"LoRA adapters \({mine}\) but this server has no adapter buffers"):
        no_lora.update_weights(good, version=1)
    nan = [(n, t * float("nan") if n.endswith("0.mlp.down_proj.lora_B.weight") else t) for n, t in good]
    with pytest.raises(
        ValueError, match=r"non-finite values .* 'model.layers.0.mlp.down_proj.lora_B.weight'"
    ):
        engine.update_weights(nan, version=1)
    # nothing was written by any of them: the engine still serves the base, at version 0
    assert engine.weight_version == 0
    assert all(not b.any() for name, b in engine.model.named_buffers() if name.endswith(".b"))
