"""The native decoder against transformers: logits, packing, loading, rope variants, errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from refractor.models import (
    CausalAttention,
    PackedAttention,
    UnsupportedModelError,
    build_model,
    load_model,
    read_hf_config,
    resolve_model_path,
)
from refractor.models.config import ModelConfig
from refractor.models.rope import rope_inv_freq

ARCH_FIXTURES = ["tiny_qwen2_path", "tiny_llama_path", "tiny_qwen3_path"]


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_logits_match_transformers_fp32(fixture, request):
    path = request.getfixturevalue(fixture)
    model = load_model(path)
    hf = _hf(path)
    # 300 tokens: past the llama3 fixture's original_max_position_embeddings (256), so rope scaling matters
    ids = torch.randint(0, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        out = model.compute_logits(model(ids, torch.arange(300), CausalAttention()))
    assert (out - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_packed_rows_equal_separate_forwards(fixture, request):
    """Three samples + padding packed in one row: each sample's logits equal HF on that sample alone."""
    path = request.getfixturevalue(fixture)
    model = load_model(path)
    hf = _hf(path)
    gen = torch.Generator().manual_seed(1)
    lengths = [7, 19, 12]
    samples = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in lengths]
    pad = 5
    input_ids = torch.cat([*samples, torch.zeros(pad, dtype=torch.long)])
    position_ids = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)])
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])
    cu = torch.tensor([0, 7, 26, 38, 43], dtype=torch.int32)
    with torch.no_grad():
        hidden = model(input_ids, position_ids, attention=PackedAttention(document_ids, cu, max(lengths)))
        logits = model.compute_logits(hidden)
        start = 0
        for sample in samples:
            ref = hf(sample[None]).logits[0]
            assert (logits[start : start + len(sample)] - ref).abs().max().item() <= 1e-4
            start += len(sample)
    assert hidden.shape == (sum(lengths) + pad, model.config.hidden_size)


def test_parameter_names_and_tied_head(tiny_qwen2_path, tiny_llama_path):
    tied = load_model(tiny_qwen2_path)
    untied = load_model(tiny_llama_path)
    hf_names = set(_hf(tiny_llama_path).state_dict())
    assert {n for n, _ in untied.named_parameters()} == hf_names
    assert untied.lm_head_weight() is untied.lm_head.weight
    assert tied.lm_head is None and tied.lm_head_weight() is tied.model.embed_tokens.weight
    assert "model.layers.0.self_attn.q_proj.bias" in dict(tied.named_parameters())
    # An HF state dict of a tied model (with lm_head.weight) loads strictly.
    state = _hf(tiny_qwen2_path).state_dict()
    assert "lm_head.weight" in state
    fresh = build_model(read_hf_config(tiny_qwen2_path))
    fresh.load_state_dict(state, strict=True)
    assert torch.equal(fresh.lm_head_weight(), tied.lm_head_weight())
    assert list(tied.buffers()) == []  # nothing for FSDP / meta init to re-create


def test_meta_build_then_init(tiny_qwen3_path):
    with torch.device("meta"):
        model = build_model(read_hf_config(tiny_qwen3_path))
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(0))
    hidden = model(torch.arange(10), torch.arange(10), CausalAttention())
    assert torch.isfinite(hidden).all()
    assert torch.equal(model.model.layers[1].self_attn.q_norm.weight, torch.ones(64))


def test_bf16_logits_close_to_transformers(tiny_qwen2_path):
    from transformers import AutoModelForCausalLM

    model = load_model(tiny_qwen2_path, dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.bfloat16).eval()
    ids = torch.arange(64) % 500
    with torch.no_grad():
        diff = (
            (
                model.compute_logits(model(ids, torch.arange(64), CausalAttention())).float()
                - hf(ids[None]).logits[0].float()
            )
            .abs()
            .max()
            .item()
        )
    assert diff <= 0.05


ROPE_CASES = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 512},
]


@pytest.mark.parametrize("rope", ROPE_CASES, ids=lambda r: r["rope_type"])
def test_rope_frequencies_match_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rope_parameters=dict(rope),
        architectures=["LlamaForCausalLM"],
    )
    ours = ModelConfig.from_hf(hf_config)
    for seq_len in (None, 4096):
        if rope["rope_type"] == "default":
            ref = 1.0 / (1e4 ** (torch.arange(0, 64, 2).float() / 64))
            ref_scale = 1.0
        else:
            ref, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu", seq_len=seq_len)
        inv, scale = rope_inv_freq(ours, seq_len)
        torch.testing.assert_close(inv, ref, rtol=1e-6, atol=0)
        assert scale == pytest.approx(ref_scale)


def test_unsupported_architecture_is_named(tmp_path, tiny_qwen2_path):
    config = read_hf_config(tiny_qwen2_path)
    config["architectures"] = ["GPTNeoXForCausalLM"]
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM.*vLLM.*AutoModelForCausalLM"):
        build_model(config)
    config = read_hf_config(tiny_qwen2_path) | {
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}
    }
    with pytest.raises(UnsupportedModelError, match="longrope"):
        build_model(config)


def test_resolves_hf_cache_offline(tmp_path, monkeypatch, tiny_qwen2_path):
    from huggingface_hub import constants

    snapshot = tmp_path / "models--acme--tiny" / "snapshots" / "abc123"
    shutil.copytree(tiny_qwen2_path, snapshot)
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_model_path("acme/tiny") == snapshot.resolve()
    assert load_model("acme/tiny").config.architecture == "Qwen2ForCausalLM"
    with pytest.raises(FileNotFoundError, match="acme/missing"):
        resolve_model_path("acme/missing")


def test_shape_mismatch_is_reported(tmp_path, tiny_qwen2_path):
    shutil.copytree(tiny_qwen2_path, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["intermediate_size"] = 128
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="_proj.weight.*has shape"):
        load_model(tmp_path / "m")


@pytest.mark.parametrize("fixture", ["tiny_qwen2_path", "tiny_llama_path"])  # with and without q/k/v biases
def test_stacked_projections_equal_separate_ones_in_float64(fixture, request):
    """The trainer's stacked q/k/v and gate/up GEMMs: same outputs and per-parameter gradients as the
    separate projections, parameter names unchanged; a LoRA projection is left unstacked."""
    from refractor.models.lora import LoraSettings, add_lora

    path = request.getfixturevalue(fixture)
    separate = load_model(path).double()
    stacked = load_model(path).double()
    assert stacked.stack_projections() == 2 * len(stacked.model.layers)
    assert [n for n, _ in stacked.named_parameters()] == [n for n, _ in separate.named_parameters()]
    ids = torch.randint(0, separate.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    outs = []
    for model in (separate, stacked):
        logits = model.compute_logits(model(ids, torch.arange(40), CausalAttention()))
        logits.square().mean().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-12, atol=1e-12)
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], grad, rtol=1e-10, atol=1e-12, msg=name)

    with_lora = load_model(path)
    add_lora(
        with_lora,
        LoraSettings(lora_rank=2, lora_alpha=4.0, lora_target_modules=("q_proj",)),
        torch.float32,
        seed=0,
    )
    # attention keeps its separate projections (q is a LoRA one); gate/up are plain and stacked
    assert with_lora.stack_projections() == len(with_lora.model.layers)
    assert not with_lora.model.layers[0].self_attn.stack_projections
