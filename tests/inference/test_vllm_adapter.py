"""The pieces of ``lora_sync: adapter`` on vLLM that need no server: the adapter folder a server starts
with (a zero PEFT adapter shaped from the checkpoint), the flags that serve it under the served
model's name, the checks an adapter push passes before it is written, and the folder's removal with
the server."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

from refractor.config.schema import VLLM_MAX_LORA_RANK
from refractor.inference.process import ServerProcess
from refractor.inference.vllm.adapter import (
    ADAPTER_DIR_ENV,
    VLLM_MAX_LORA_RANKS,
    AdapterFolder,
    adapter_shapes,
    create_adapter_folder,
    max_lora_rank,
)
from refractor.inference.vllm.launcher import (
    VllmServerSettings,
    VllmStartError,
    start_vllm_server,
    vllm_command,
)
from refractor.inference.vllm.update_check import ExpectedTensor
from refractor.models.lora import ADAPTER_SCALE_NAME

TARGETS = ("q_proj", "down_proj")


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_vllm_lora_ranks_round_up_to_the_ones_vllm_takes():
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 64, 100, 320, 512)] == [1, 8, 8, 16, 64, 128, 320, 512]
    assert VLLM_MAX_LORA_RANKS[-1] == VLLM_MAX_LORA_RANK  # the config check's bound (schema imports no torch)
    with pytest.raises(ValueError, match="lora_rank 513: vLLM serves LoRA ranks 1 to 512"):
        max_lora_rank(513)


def test_a_server_starts_with_a_zero_adapter_shaped_from_the_checkpoint(tiny_qwen2_path):
    folder = create_adapter_folder(str(tiny_qwen2_path), 4, TARGETS)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        # alpha = rank: vLLM's scaling is 1, the pushes carry B times the run's scale
        assert (config["r"], config["lora_alpha"], config["target_modules"]) == (
            4,
            4,
            ["q_proj", "down_proj"],
        )
        tensors = load_file(folder / "adapter_model.safetensors")
        # the tiny model: hidden 128, q_proj 128 -> 128, down_proj 256 -> 128, two layers
        expected = {}
        for layer in (0, 1):
            expected[f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_A.weight"] = (4, 128)
            expected[f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_B.weight"] = (128, 4)
            expected[f"base_model.model.model.layers.{layer}.mlp.down_proj.lora_A.weight"] = (4, 256)
            expected[f"base_model.model.model.layers.{layer}.mlp.down_proj.lora_B.weight"] = (128, 4)
        assert {name: tuple(t.shape) for name, t in tensors.items()} == expected
        assert all(t.abs().sum() == 0 for t in tensors.values())  # B = 0: the base until the first push
        assert folder.stat().st_mode & 0o077 == 0  # private to the user
    finally:
        shutil.rmtree(folder)


def test_a_checkpoint_without_llama_projections_is_named():
    header = {
        "model.layers.0.self_attn.q_proj.weight": ExpectedTensor((64, 64), True),
        "model.layers.0.mlp.down_proj.weight": ExpectedTensor((64, 128), True),
        "model.layers.1.self_attn.q_proj.weight": ExpectedTensor((64, 64), True),
    }
    with pytest.raises(ValueError, match="decoder layer 1 has no down_proj weight"):
        adapter_shapes(header, 4, TARGETS)
    fused = {"model.layers.0.self_attn.qkv_proj.weight": ExpectedTensor((192, 64), True)}
    with pytest.raises(ValueError, match="decoder layer 0 has no q_proj, down_proj weight"):
        adapter_shapes(fused, 4, TARGETS)
    with pytest.raises(ValueError, match="no decoder projections named as Llama's"):
        adapter_shapes({"transformer.h.0.attn.c_attn.weight": ExpectedTensor((192, 64), True)}, 4, TARGETS)
    with pytest.raises(ValueError, match="lora_rank 80 exceeds model.layers.0.self_attn.q_proj.weight's"):
        adapter_shapes(header, 80, ("q_proj",))


def test_a_server_without_a_local_checkpoint_for_its_adapter_is_refused_at_start(tmp_path):
    with pytest.raises(VllmStartError, match="needs '/no/such/model' as a local safetensors checkpoint"):
        start_vllm_server(
            "/no/such/model", settings=VllmServerSettings(lora_rank=4), log_path=tmp_path / "s.log"
        )


def test_the_adapter_is_served_under_the_served_models_name(tmp_path):
    settings = VllmServerSettings(
        served_model_name="policy", lora_rank=4, lora_target_modules=("down_proj", "q_proj")
    )
    argv, env = vllm_command(
        "/m", "127.0.0.1", 1, settings, on_cpu=True, control_token="t" * 20, adapter_dir=tmp_path
    )
    # vLLM refuses an adapter named as a base model: the base gets its own name
    assert flag(argv, "--served-model-name") == "policy:base"
    assert json.loads(flag(argv, "--lora-modules")) == {"name": "policy", "path": str(tmp_path)}
    assert (
        "--enable-lora" in argv and flag(argv, "--max-lora-rank") == "8" and flag(argv, "--max-loras") == "1"
    )
    start = argv.index("--lora-target-modules") + 1
    assert argv[start : start + 3] == ["q_proj", "down_proj", "--lora-modules"]
    assert env[ADAPTER_DIR_ENV] == str(tmp_path)  # where the weight-transfer backend writes the pushes
    plain, plain_env = vllm_command(
        "/m", "127.0.0.1", 1, VllmServerSettings(served_model_name="policy"), on_cpu=True
    )
    assert flag(plain, "--served-model-name") == "policy" and "--enable-lora" not in plain
    assert ADAPTER_DIR_ENV not in plain_env
    with pytest.raises(ValueError, match="needs the folder of its adapter"):
        vllm_command("/m", "127.0.0.1", 1, settings, on_cpu=True)


def _push(
    folder: AdapterFolder, scale: float = 2.0, replace: dict | None = None, drop: str | None = None
) -> list[tuple[str, torch.Tensor]]:
    """A complete adapter push for ``folder``, with some tensors replaced or one dropped."""
    replace = replace or {}
    named = [
        (name, replace.get(name, torch.randn(shape))) for name, shape in folder.shapes.items() if name != drop
    ]
    return [*named, (ADAPTER_SCALE_NAME, torch.tensor([scale]))]


def test_an_adapter_push_is_checked_whole_and_written_with_b_times_the_scale(tiny_qwen2_path):
    folder = AdapterFolder(create_adapter_folder(str(tiny_qwen2_path), 4, TARGETS))
    try:
        assert folder.describe() == "rank 4 on q_proj, down_proj"
        assert len(folder.names) == 9  # 2 layers x 2 projections x (A, B), and the scale
        named = _push(folder)
        writes, errors = folder.plan(named)
        assert errors == []
        folder.write(writes)
        stored = load_file(folder.folder / "adapter_model.safetensors")
        for name, tensor in named[:-1]:
            want = tensor * 2.0 if ".lora_B." in name else tensor
            assert torch.equal(stored[f"base_model.model.{name}"], want)
        a = "model.layers.1.mlp.down_proj.lora_A.weight"
        b = "model.layers.0.self_attn.q_proj.lora_B.weight"
        _, errors = folder.plan(_push(folder, replace={a: torch.full((4, 256), float("nan"))}, drop=b))
        assert errors == [
            f"{a!r} holds non-finite values (NaN or Inf)",
            f"the update lacks adapter weights {b!r}",
        ]
        _, errors = folder.plan(_push(folder, scale=float("inf")))
        assert errors == ["'lora.scale' is inf"]
        with pytest.raises(
            ValueError, match=r"\(rank 2 on q_proj, down_proj\) do not fit this server's adapter"
        ):
            folder.plan([(n, t[:2] if ".lora_A." in n else t[:, :2]) for n, t in _push(folder)[:-1]])
    finally:
        shutil.rmtree(folder.folder)


def test_a_stopped_server_takes_its_scratch_folder_along(tmp_path):
    scratch = tmp_path / "adapter"
    scratch.mkdir()
    (scratch / "adapter_model.safetensors").write_bytes(b"x")
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    server = ServerProcess.spawn(
        argv, url="http://x", log_path=tmp_path / "s.log", what="a server", scratch_dir=scratch
    )
    assert server.alive()
    server.stop(grace_s=5)
    assert not scratch.exists() and server.process.returncode is not None
