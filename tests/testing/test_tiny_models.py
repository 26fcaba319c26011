"""The offline tiny-model builder: real HF checkpoints that load, chat-template and generate."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from refractor.testing import TinyModelSpec, build_tiny_model, build_tokenizer, qwen25_shaped


@pytest.mark.parametrize("fixture", ["tiny_qwen2_path", "tiny_llama_path", "tiny_qwen3_path"])
def test_tiny_model_loads_and_generates(fixture, request):
    path = request.getfixturevalue(fixture)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in path.iterdir()
    }
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["head_dim"] == 64
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.vocab_size >= len(tok)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Using 3 and 7 make 10"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )["input_ids"]
    assert tok.decode(ids[0]).endswith("<|im_start|>assistant\n")
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 5 or tok.eos_token_id in out[0, ids.shape[1] :].tolist()


def test_tokenizer_round_trip_and_specials():
    tok = build_tokenizer()
    text = "Using the numbers 3, 7 and 25: (25 - 7) * 3 = 54 ✓"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: lossless, even for non-ASCII
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id != tok.pad_token_id


def test_build_is_deterministic_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("REFRACTOR_CACHE", str(tmp_path))
    spec = TinyModelSpec(num_hidden_layers=1, seed=5)
    a = build_tiny_model(spec)
    w1 = load_file(a / "model.safetensors")
    mtime = (a / "model.safetensors").stat().st_mtime
    assert build_tiny_model(spec) == a and (a / "model.safetensors").stat().st_mtime == mtime  # cached
    import shutil

    shutil.rmtree(a)
    w2 = load_file(build_tiny_model(spec) / "model.safetensors")  # rebuilt from scratch
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    other = load_file(build_tiny_model(TinyModelSpec(num_hidden_layers=1, seed=6)) / "model.safetensors")
    assert not torch.equal(other["model.embed_tokens.weight"], w1["model.embed_tokens.weight"])


def test_qwen25_shape_config_only():
    path = qwen25_shaped("0.5b", with_weights=False)
    cfg = json.loads((path / "config.json").read_text())
    assert (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
        cfg["tie_word_embeddings"],
    ) == (896, 24, 14, 2, 4864, 151936, True)
    assert not (path / "model.safetensors").exists()
