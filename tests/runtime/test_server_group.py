"""The server group: settings read once from the config, translated into each engine's command line;
a server that fails to start is named (real Ray actor)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest
import ray
from ray.util.placement_group import remove_placement_group

from refractor.config import RefractorConfig
from refractor.inference.process import ServerProcess, ServerStartError
from refractor.inference.vllm.launcher import VllmServerSettings
from refractor.runtime.cluster import reserve
from refractor.runtime.server_group import (
    NativeEngineArgs,
    RayServerGroup,
    ServerGroupSettings,
    choose_engine,
    launch_server,
    reachable_url,
)


def server_config(**overrides) -> RefractorConfig:
    values = dict(
        environments=[{"name": "countdown"}],
        model="/models/policy",
        max_model_len=512,
        max_tokens=256,
        kv_cache_memory_gb=0.25,
        max_num_seqs=4,
        seed=3,
        chat_template="{{ messages }}",
        ray_placement_timeout_s=77,
    )
    return RefractorConfig(**{**values, **overrides})


def test_settings_are_read_once_from_the_config():
    cfg = server_config()
    s = ServerGroupSettings.from_config(cfg, 0.9)
    assert (s.model, s.host, s.chat_template, s.startup_timeout_s) == (
        "/models/policy",
        "auto",
        "{{ messages }}",
        77.0,
    )
    assert s.native == NativeEngineArgs(
        max_model_len=512,
        kv_cache_memory_gb=0.25,
        gpu_memory_utilization=0.9,
        max_num_seqs=4,
        max_num_batched_tokens=None,
        seed=3,
    )
    assert s.vllm == VllmServerSettings.from_config(cfg, served_model_name="/models/policy")
    assert s.vllm.startup_timeout_s == 77.0


def test_the_native_engine_runs_every_lane_unless_max_num_seqs_caps_it():
    lanes = server_config(max_num_seqs=None, max_concurrent_prompts_per_server=48, group_size=8)
    assert ServerGroupSettings.from_config(lanes, 0.9).native.max_num_seqs == 384
    capped = server_config(max_num_seqs=100, max_concurrent_prompts_per_server=48, group_size=8)
    assert ServerGroupSettings.from_config(capped, 0.9).native.max_num_seqs == 100
    # vLLM keeps its own default
    assert ServerGroupSettings.from_config(lanes, 0.9).vllm.max_num_seqs is None


class Spawned:
    """Stands in for ServerProcess.spawn: records the command line, is healthy at once."""

    def __init__(self) -> None:
        self.argv: list[str] = []
        self.env: dict[str, str] = {}
        self.url = ""
        self.timeout_s = 0.0
        self.scratch_dir = None

    def spawn(self, argv, *, url, log_path, what, env=None, die_with_parent=False, scratch_dir=None):
        self.argv = argv
        self.env = env or {}
        self.url = url
        self.scratch_dir = scratch_dir
        assert die_with_parent  # the server dies with its actor
        return self

    def wait_healthy(self, timeout_s: float):
        self.timeout_s = timeout_s
        return self


def option(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


@pytest.fixture
def spawned(monkeypatch) -> Spawned:
    fake = Spawned()
    monkeypatch.setattr(ServerProcess, "spawn", lambda argv, **kw: fake.spawn(argv, **kw))
    return fake


TOKEN = "the-run-control-token"


def test_native_server_command_line(spawned, tmp_path):
    launch_server(ServerGroupSettings.from_config(server_config(), 0.9), "native", tmp_path / "s.log", TOKEN)
    argv = spawned.argv
    assert argv[argv.index("serve") :][:5] == ["serve", "--model", "/models/policy", "--engine", "native"]
    # control routes on, guarded by the run's token, which travels in the environment only
    assert "--enable-weight-updates" in argv and TOKEN not in " ".join(argv)
    assert spawned.env["REFRACTOR_CONTROL_TOKEN"] == TOKEN
    expected = {
        "--host": "127.0.0.1",  # inference_host: auto, outside a multi-node cluster
        "--max-model-len": "512",
        "--kv-cache-memory-gb": "0.25",
        "--gpu-memory-utilization": "0.9",
        "--max-num-seqs": "4",
        "--seed": "3",
        "--served-model-name": "/models/policy",
        "--chat-template": "{{ messages }}",
    }
    assert {flag: option(argv, flag) for flag in expected} == expected
    assert "--max-num-batched-tokens" not in argv  # unset keys are left to the engine
    port = int(option(argv, "--port"))
    assert spawned.url == f"http://127.0.0.1:{port}" and spawned.timeout_s == 77.0
    assert "--no-engine-process" in argv  # the engine thread, unless the config asks for a process


def test_native_engine_process_reaches_the_command_line(spawned, tmp_path):
    settings = ServerGroupSettings.from_config(server_config(native_engine_process=True), 0.9)
    launch_server(settings, "native", tmp_path / "s.log", TOKEN)
    assert "--engine-process" in spawned.argv and "--no-engine-process" not in spawned.argv


def test_adapter_sync_gives_the_native_servers_the_trainers_adapter_shape(spawned, tmp_path):
    lora = dict(lora_rank=8, lora_target_modules=("q_proj", "down_proj"))
    settings = ServerGroupSettings.from_config(server_config(**lora, lora_sync="adapter"), 0.9)
    launch_server(settings, "native", tmp_path / "s.log", TOKEN)
    assert option(spawned.argv, "--lora-rank") == "8"
    assert option(spawned.argv, "--lora-target-modules") == "q_proj,down_proj"
    # merged weights need no adapter buffers on the servers
    launch_server(
        ServerGroupSettings.from_config(server_config(**lora), 0.9), "native", tmp_path / "m.log", TOKEN
    )
    assert option(spawned.argv, "--lora-rank") == "0" and "--lora-target-modules" not in spawned.argv


def test_adapter_sync_serves_the_adapter_on_vllm_under_the_served_name(spawned, tmp_path, tiny_qwen2_path):
    model = str(tiny_qwen2_path)
    lora = dict(lora_rank=8, lora_target_modules=("q_proj", "down_proj"), lora_sync="adapter")
    settings = ServerGroupSettings.from_config(server_config(model=model, **lora), 0.9)
    launch_server(settings, "vllm", tmp_path / "s.log", TOKEN)
    try:
        assert option(spawned.argv, "--served-model-name") == f"{model}:base"
        assert json.loads(option(spawned.argv, "--lora-modules")) == {
            "name": model,
            "path": str(spawned.scratch_dir),
        }
        assert option(spawned.argv, "--max-lora-rank") == "8"
        assert (spawned.scratch_dir / "adapter_model.safetensors").is_file()  # removed when the server stops
    finally:
        shutil.rmtree(spawned.scratch_dir)
    # merged weights: a plain server
    launch_server(
        ServerGroupSettings.from_config(server_config(model=model, lora_rank=8), 0.9),
        "vllm",
        tmp_path / "m.log",
        TOKEN,
    )
    assert "--enable-lora" not in spawned.argv and spawned.scratch_dir is None


def test_vllm_server_command_line(spawned, tmp_path):
    settings = ServerGroupSettings.from_config(server_config(inference_host="0.0.0.0"), 0.9)
    launch_server(settings, "vllm", tmp_path / "s.log", TOKEN)
    argv = spawned.argv
    assert spawned.env["REFRACTOR_CONTROL_TOKEN"] == TOKEN and TOKEN not in " ".join(argv)
    expected = {
        "--model": "/models/policy",
        "--host": "0.0.0.0",  # an explicit inference_host is kept
        "--max-model-len": "512",
        "--seed": "3",
        "--max-num-seqs": "4",
        "--served-model-name": "/models/policy",
        "--kv-cache-memory-bytes": str(2**28),
    }
    assert {flag: option(argv, flag) for flag in expected} == expected
    assert spawned.url == f"http://127.0.0.1:{option(argv, '--port')}" and spawned.timeout_s == 77.0


def test_wildcard_urls_are_reached_through_the_node_address():
    assert reachable_url("http://0.0.0.0:8100", "10.0.0.5") == "http://10.0.0.5:8100"
    assert reachable_url("http://127.0.0.1:8100", "10.0.0.5") == "http://127.0.0.1:8100"


def test_explicit_engines_are_kept_and_auto_picks_native_for_the_architectures_it_implements(
    tiny_qwen2_path, tiny_llama_path, tiny_qwen3_path, tmp_path
):
    assert choose_engine("native", str(tiny_qwen2_path)) == ("native", "`inference_engine: native`")
    for path, arch in (
        (tiny_qwen2_path, "Qwen2ForCausalLM"),
        (tiny_llama_path, "LlamaForCausalLM"),
        (tiny_qwen3_path, "Qwen3ForCausalLM"),
    ):
        assert choose_engine("auto", str(path)) == ("native", f"auto: the native engine implements {arch}")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GemmaForCausalLM"]}))
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(
            ServerStartError, match="GemmaForCausalLM is not implemented .* vLLM is not installed"
        ):
            choose_engine("auto", str(tmp_path))
    else:
        assert choose_engine("auto", str(tmp_path)) == (
            "vllm",
            "auto: the native engine does not implement GemmaForCausalLM",
        )


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_server_that_fails_to_start_is_named(local_ray, tmp_path):
    cfg = server_config(inference_host="256.0.0.1")  # no such address: the start fails before any spawn
    reservation = reserve("inference servers", 1, 1, 0, "PACK", 60, "cpus", "servers")
    group = RayServerGroup(cfg, reservation, "native", str(tmp_path / "logs"), TOKEN, 0.9)
    try:
        with pytest.raises(ServerStartError, match=r"inference server server-0 \(native\) failed to start"):
            group.start()
    finally:
        group.shutdown()
        remove_placement_group(reservation.group)


def test_a_server_actor_launches_without_importing_torch():
    """A run's server actors only spawn the server process: what they import (their module, the
    settings they are sent, the launchers) stays clear of torch, which would add a second of
    start-up to every server on the critical path of a run's start."""
    code = (
        "import sys\n"
        "import refractor.runtime.server_group, refractor.inference.native_launcher\n"
        "import refractor.inference.vllm.launcher\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
