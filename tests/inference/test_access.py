"""Who may call which route: the control routes need the server's control token (and exist only
when it has one), an API key guards generation, servers bind loopback by default, a worker can
never be made to listen for a rendezvous, and the rendezvous store listens on its address only."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import torch.distributed as dist

from refractor.inference.access import RouteKind, route_kind
from refractor.inference.native_launcher import start_native_server
from refractor.inference.process import free_port
from refractor.testing import TEST_CONTROL_TOKEN
from refractor.weight_sync.process_group import host_store

CONTROL = {"Authorization": f"Bearer {TEST_CONTROL_TOKEN}"}
ENGINE_ARGS = {"max_model_len": 256, "kv_cache_memory_gb": 0.02}
CONTROL_CALLS = [
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/abort_requests"),
    ("POST", "/inference/v1/abort_requests"),
    ("GET", "/get_world_size"),
    ("GET", "/weight_info"),
    ("POST", "/start_weight_update"),
    ("POST", "/update_weights"),
    ("POST", "/finish_weight_update"),
    ("POST", "/init_weight_transfer_engine"),
    ("POST", "/shutdown_weight_transfer_engine"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/collective_rpc"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
]


@pytest.mark.parametrize(
    "path,kind",
    [
        ("/health", RouteKind.OPEN),
        ("/metrics", RouteKind.OPEN),
        ("/v1/completions", RouteKind.GENERATION),
        ("/v1/chat/completions", RouteKind.GENERATION),
        ("/inference/v1/generate", RouteKind.GENERATION),
        ("/tokenize", RouteKind.GENERATION),
        ("/inference/v1/abort_requests", RouteKind.CONTROL),
        ("/v1/load_lora_adapter", RouteKind.CONTROL),
        ("/pause", RouteKind.CONTROL),
        ("/update_weights", RouteKind.CONTROL),
        ("/collective_rpc", RouteKind.CONTROL),
        ("/docs", RouteKind.CONTROL),
        ("/something_new", RouteKind.CONTROL),  # deny by default
    ],
)
def test_routes_are_classified_deny_by_default(path, kind):
    assert route_kind(path) is kind


def listening_addresses(pid: int) -> set[str]:
    """The local addresses a process and its children listen on."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return {c.laddr.ip for p in procs for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}


@pytest.fixture(scope="module")
def guarded(tiny_qwen2_path):
    handle = start_native_server(
        str(tiny_qwen2_path), engine_args=ENGINE_ARGS, control_token=TEST_CONTROL_TOKEN
    )
    yield handle
    handle.stop()


def test_control_routes_need_the_token(guarded):
    for method, path in CONTROL_CALLS:
        for headers in ({}, {"Authorization": "Bearer not-the-token-at-all"}, {"Authorization": "Basic x"}):
            response = httpx.request(method, guarded.url + path, headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers, response.text)
            assert "control token" in response.json()["error"]["message"]
    assert httpx.post(guarded.url + "/pause", params={"mode": "keep"}, headers=CONTROL).status_code == 200
    assert httpx.get(guarded.url + "/is_paused", headers=CONTROL).json() == {"is_paused": True}
    assert httpx.post(guarded.url + "/resume", headers=CONTROL).status_code == 200
    assert httpx.get(guarded.url + "/weight_info", headers=CONTROL).json() == {"weight_version": "0"}
    assert httpx.get(guarded.url + "/docs", headers=CONTROL).status_code == 404  # API docs are off
    # generation and liveness stay open (no API key configured)
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    assert httpx.post(guarded.url + "/v1/completions", json=body, timeout=60).status_code == 200
    assert httpx.get(guarded.url + "/health").status_code == 200


def test_a_worker_never_hosts_the_rendezvous_and_bad_parameters_are_400(guarded):
    base = {"master_address": "127.0.0.1", "master_port": 29999, "world_size": 2, "rank_offset": 1}
    for changes, needle in [
        ({"rank_offset": 0}, "rank 0 is the trainer's"),
        ({"rank_offset": 2}, "rank 2 of world_size 2"),
        ({"master_port": 0}, "master_port"),
        ({"master_port": "x"}, "init_info.master_port: Input should be a valid integer"),
        ({"backend": "mpi"}, "backend"),
        ({"master_address": None} | {"master_port": None}, "init_info"),
    ]:
        info = {**base, **changes}
        response = httpx.post(
            guarded.url + "/init_weight_transfer_engine",
            json={"init_info": info},
            headers=CONTROL,
            timeout=30,
        )
        assert response.status_code == 400, (changes, response.text)
        assert needle in response.text, (needle, response.text)
    missing = {k: v for k, v in base.items() if k != "world_size"}
    response = httpx.post(
        guarded.url + "/init_weight_transfer_engine", json={"init_info": missing}, headers=CONTROL
    )
    assert response.status_code == 400 and "init_info.world_size: Field required" in response.text
    assert listening_addresses(guarded.process.pid) == {"127.0.0.1"}  # nothing new is listening


def test_serve_defaults_to_loopback_with_control_routes_off(tiny_qwen2_path, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REFRACTOR_CONTROL_TOKEN"}
    env["REFRACTOR_CONTROL_TOKEN"] = TEST_CONTROL_TOKEN  # exported, but the routes were not asked for
    argv = [
        sys.executable,
        "-m",
        "refractor.cli",
        "serve",
        "--model",
        str(tiny_qwen2_path),
        "--port",
        str(port),
    ]
    argv += ["--max-model-len", "256", "--kv-cache-memory-gb", "0.02"]
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert listening_addresses(process.pid) == {"127.0.0.1"}
        for method, path in CONTROL_CALLS:
            response = httpx.request(method, url + path, headers=CONTROL, timeout=30)
            assert response.status_code == 403, (path, response.text)
            assert "--enable-weight-updates" in response.json()["error"]["message"]
        assert (
            httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200
        )
    finally:
        process.terminate()
        process.wait(30)
        log.close()


@pytest.mark.parametrize(
    "flags,env_token,needle",
    [
        (["--enable-weight-updates"], None, "needs a control token"),
        (["--enable-weight-updates"], "short", "at least 16 characters"),
        (["--api-key", "short"], None, "--api-key must be at least 16"),
    ],
)
def test_serve_refuses_weight_updates_without_a_strong_token(flags, env_token, needle):
    from typer.testing import CliRunner

    from refractor.cli import app

    env = {"REFRACTOR_CONTROL_TOKEN": env_token or ""}
    result = CliRunner().invoke(app, ["serve", "--model", "/nonexistent", *flags], env=env)
    assert result.exit_code != 0
    assert needle in result.output


def test_an_api_key_guards_generation_only(tiny_qwen2_path):
    import asyncio

    from transformers import AutoTokenizer

    from refractor.inference.engine import EngineConfig, LLMEngine
    from refractor.inference.engine.async_engine import AsyncLLMEngine
    from refractor.inference.server import create_app

    key = "an-api-key-of-sufficient-length"
    engine = AsyncLLMEngine(
        LLMEngine.from_pretrained(tiny_qwen2_path, EngineConfig(max_model_len=128, kv_cache_memory_gb=0.01))
    )
    app = create_app(engine, AutoTokenizer.from_pretrained(tiny_qwen2_path), "t", api_key=key)
    body = {"prompt": [1, 2, 3], "max_tokens": 2}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [
                (await client.post("/v1/completions", json=body)).status_code,
                (
                    await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer no"})
                ).status_code,
                (await client.post("/tokenize", json={"prompt": "hi"})).status_code,
                (
                    await client.post(
                        "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                    )
                ).status_code,
                (await client.get("/health")).status_code,
                (await client.get("/metrics")).status_code,
                # the key does not open the control routes, which this app does not have at all
                (await client.post("/pause", headers={"Authorization": f"Bearer {key}"})).status_code,
            ]

    try:
        assert asyncio.run(main()) == [401, 401, 401, 200, 200, 200, 403]
    finally:
        engine.shutdown()


def test_the_rendezvous_store_listens_on_its_address_only():
    store = host_store("127.0.0.1", world_size=2, init_timeout_s=10)
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    listening = {
        c.laddr.ip
        for c in psutil.Process().net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port
    }
    assert listening == {"127.0.0.1"}
    with pytest.raises(OSError, match="cannot listen on 203.0.113.77"):  # not an address of this machine
        host_store("203.0.113.77", world_size=2, init_timeout_s=10)
