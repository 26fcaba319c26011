"""`refractor serve`'s arguments: one model resolution for both engines, the sequence limit from the
model's config, readable help."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from refractor.cli import app
from refractor.inference.serve_cli import resolve_model


def test_model_names_resolve_and_the_length_defaults_to_the_models(tiny_qwen2_path):
    path, length = resolve_model("refractor-testing/tiny-qwen2", None)
    assert path == tiny_qwen2_path and length == 2048  # the tiny model's max_position_embeddings
    assert resolve_model(str(tiny_qwen2_path), 300) == (tiny_qwen2_path, 300)
    with pytest.raises(typer.BadParameter, match="hf download no/such-model"):
        resolve_model("no/such-model", None)


def test_vllm_gets_the_resolved_directory_and_the_given_name(tiny_qwen2_path, monkeypatch):
    calls = {}

    def fake_serve_vllm(model, host, port, settings, **kwargs):
        calls.update(model=model, settings=settings)

    monkeypatch.setattr("refractor.inference.vllm.launcher.serve_vllm", fake_serve_vllm)
    result = CliRunner().invoke(app, ["serve", "--model", "refractor-testing/tiny-qwen2", "--engine", "vllm"])
    assert result.exit_code == 0, result.output
    assert calls["model"] == tiny_qwen2_path
    assert calls["settings"].max_model_len == 2048
    assert calls["settings"].served_model_name == "refractor-testing/tiny-qwen2"


def test_help_shows_whole_flag_names():
    result = CliRunner().invoke(app, ["serve", "--help"], terminal_width=80)
    assert result.exit_code == 0
    for flag in ("--decode-steps-between-prefills", "--async-scheduling / --no-async-scheduling"):
        assert flag in result.output, result.output


def test_lora_flags_give_the_native_engine_its_adapter_shape(monkeypatch):
    configs = []
    monkeypatch.setattr(
        "refractor.inference.server.run_native_server",
        lambda *a, engine_config, **kw: configs.append(engine_config),
    )
    serve = ["serve", "--model", "refractor-testing/tiny-qwen2"]
    result = CliRunner().invoke(app, [*serve, "--lora-rank", "8", "--lora-target-modules", "q_proj, v_proj"])
    assert result.exit_code == 0, result.output
    assert (configs[0].lora_rank, configs[0].lora_target_modules) == (8, ("q_proj", "v_proj"))
    result = CliRunner().invoke(app, [*serve, "--lora-rank", "8", "--lora-target-modules", "qkv"])
    assert result.exit_code != 0 and "--lora-target-modules" in result.output and "qkv" in result.output
    result = CliRunner().invoke(app, [*serve, "--engine", "vllm", "--lora-rank", "8"])
    assert result.exit_code != 0 and "native engine only" in result.output
    assert CliRunner().invoke(app, serve).exit_code == 0 and configs[-1].lora_rank == 0  # no adapters


def test_a_vllm_cpu_server_whose_step_cannot_hold_a_prompt_is_refused_in_one_line(monkeypatch):
    """vLLM on CPU runs without chunked prefill (a split seeded prompt kills its engine), so a step
    must hold the longest prompt; the refusal comes before vLLM starts."""
    started = []
    monkeypatch.setattr("refractor.inference.vllm.launcher.cuda_available", lambda: False)
    monkeypatch.setattr("os.execvpe", lambda *args: started.append(args))
    serve = ["serve", "--model", "refractor-testing/tiny-qwen2", "--engine", "vllm", "--max-model-len", "512"]
    result = CliRunner().invoke(app, [*serve, "--max-num-batched-tokens", "256"], terminal_width=400)
    assert result.exit_code != 0 and not started
    assert "max_num_batched_tokens (256) is below max_model_len (512)" in result.output, result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(app, [*serve, "--max-num-batched-tokens", "512"])
    assert result.exit_code == 0, result.output
    assert "--no-enable-chunked-prefill" in started[0][1]
