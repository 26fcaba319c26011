"""Bad weight-update inputs on the native server are refused with a 4xx and a one-line reason, never a
500 with a traceback, and leave the server serving: bad parameters of the weight routes, and malformed
weight streams sent by a test that plays the trainer's rank 0 of a real gloo group. (Bad generation
and /abort_requests bodies: ``test_server.py::test_bad_requests_are_400_and_harmless``.)"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from native_thread_server import ThreadServer

from refractor.testing import TEST_CONTROL_TOKEN
from refractor.weight_sync.buckets import iter_buckets
from refractor.weight_sync.data_plane import KIND_END, KIND_FLAT, WorkerReport
from refractor.weight_sync.process_group import TransferGroup, host_store
from refractor.weight_sync.sender import WeightSender
from refractor.weight_sync.settings import WeightSyncSettings

CONTROL = {"Authorization": f"Bearer {TEST_CONTROL_TOKEN}"}
GOOD_INIT = {"master_address": "127.0.0.1", "master_port": 29999, "world_size": 2, "rank_offset": 1}


@pytest.fixture(scope="module")
def server(tiny_qwen2_path):
    handle = ThreadServer("bad-inputs-0", tiny_qwen2_path)
    yield handle
    handle.stop()


def assert_refused_and_harmless(server: ThreadServer, response: httpx.Response, needle: str) -> None:
    assert 400 <= response.status_code < 500, response.text
    assert "Traceback" not in response.text
    message = response.json()["error"]["message"]
    assert needle in message and "\n" not in message, message
    assert httpx.get(server.url + "/health").status_code == 200
    completion = httpx.post(
        server.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}
    )
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2


def _init(**changes) -> dict:
    return {"init_info": {**GOOD_INIT, **changes}}


@pytest.mark.parametrize(
    "path,body,needle",
    [
        ("/init_weight_transfer_engine", {"init_info": {"master_port": 1}}, "master_address"),
        ("/init_weight_transfer_engine", _init(master_address=5), "master_address"),
        ("/init_weight_transfer_engine", _init(master_port="x"), "master_port"),
        ("/init_weight_transfer_engine", _init(master_port=0), "master_port must be in 1..65535"),
        ("/init_weight_transfer_engine", _init(master_port=70000), "master_port must be in 1..65535"),
        ("/init_weight_transfer_engine", _init(backend="mpi"), "backend must be 'gloo' or 'nccl'"),
        ("/init_weight_transfer_engine", _init(backend="nccl"), "'nccl' needs a CUDA engine"),
        ("/init_weight_transfer_engine", _init(payload="cuda_ipc"), "'cuda_ipc' needs a CUDA engine"),
        ("/init_weight_transfer_engine", _init(payload="shm"), "payload"),
        ("/init_weight_transfer_engine", _init(rank_offset=0), "rank 0 is the trainer's"),
        ("/init_weight_transfer_engine", _init(rank_offset=2), "got rank 2 of world_size 2"),
        ("/init_weight_transfer_engine", _init(world_size=2**70), "world_size"),
        ("/init_weight_transfer_engine", _init(group=[1]), "group"),
        ("/init_weight_transfer_engine", _init(init_timeout_s=-1), "init_timeout_s"),
        ("/init_weight_transfer_engine", json.dumps(_init(timeout_s=float("inf"))), "timeout_s"),
        ("/init_weight_transfer_engine", json.dumps(_init(timeout_s=float("nan"))), "timeout_s"),
        ("/init_weight_transfer_engine", {"init_info": [1, 2]}, "init_info"),
        ("/init_weight_transfer_engine", _init(master_port=9, init_timeout_s=1), "cannot join"),
        ("/update_weights", {"update_info": {"group": [1]}}, "update_info.group"),
        ("/update_weights", {"update_info": {"version": {"v": 1}}}, "update_info.version"),
        ("/update_weights", {"update_info": {"group": "never-made"}}, "'never-made' was never initialized"),
        ("/update_weights", {}, "update_info"),
        ("/finish_weight_update", {"weight_version": 5}, "weight_version"),
        ("/abort_requests", {"request_ids": ["\ud800"]}, "Invalid JSON"),  # a lone surrogate
        ("/abort_requests", b"\xff\xfe{", "JSON"),
    ],
)
def test_bad_weight_route_parameters_are_4xx_and_harmless(server, path, body, needle):
    before = httpx.get(server.url + "/weight_info", headers=CONTROL).json()
    if path == "/update_weights":
        assert httpx.post(server.url + "/start_weight_update", headers=CONTROL).status_code == 200
    content = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body))
    headers = {"content-type": "application/json", **CONTROL}
    response = httpx.post(server.url + path, content=content, headers=headers, timeout=30)
    assert_refused_and_harmless(server, response, needle)
    assert httpx.get(server.url + "/weight_info", headers=CONTROL).json() == before
    if path == "/update_weights":  # the rejected update is over: the next one can start
        assert httpx.post(server.url + "/start_weight_update", headers=CONTROL).status_code == 200
        assert httpx.post(server.url + "/finish_weight_update", headers=CONTROL).status_code == 200


# ---- malformed weight streams -----------------------------------------------------------------
def header(kind: int, payload_bytes: int, meta_bytes: int, n_tensors: int) -> torch.Tensor:
    return torch.tensor([kind, payload_bytes, meta_bytes, n_tensors], dtype=torch.int64)


def metadata(entries) -> bytes:
    return entries if isinstance(entries, bytes) else json.dumps(entries).encode()


def bucket(entries, payload_bytes: int | None = None, kind: int = KIND_FLAT) -> list[torch.Tensor]:
    """Header + metadata of one bucket; ``payload_bytes`` defaults to 4 bytes an element."""
    blob = metadata(entries)
    if payload_bytes is None:
        payload_bytes = sum(4 * torch.Size(shape).numel() for _, _, shape in entries)
    count = len(entries) if isinstance(entries, list) else 1
    return [
        header(kind, payload_bytes, len(blob), count),
        torch.frombuffer(bytearray(blob), dtype=torch.uint8),
    ]


END = header(KIND_END, 0, 0, 0)


def whole_update(name: str, dtype: str, values: torch.Tensor) -> list[torch.Tensor]:
    """A stream that follows the protocol to its END header, carrying one tensor."""
    payload = values.contiguous().view(-1).view(torch.uint8)
    return [
        *bucket([[name, dtype, list(values.shape)]], payload.numel()),
        payload,
        END,
    ]


NORM = "model.norm.weight"  # a parameter of the tiny model: 128 float32 values
STREAMS = {
    "unknown bucket kind": ([header(7, 16, 0, 1)], "unknown kind 7"),
    "negative metadata size": ([header(KIND_FLAT, 16, -5, 1)], "-5 metadata bytes"),
    "huge metadata size": ([header(KIND_FLAT, 16, 2**40, 1)], "metadata bytes (at most"),
    "no metadata for a new bucket": ([header(KIND_FLAT, 16, 0, 1)], "arrived without metadata"),
    "metadata not utf-8 json": (bucket(b"\xff\xfe{[", 16), "metadata is not JSON"),
    "metadata not a list": (bucket(b'{"a": 1}', 16), "metadata is not a list"),
    "fractional dimension": (bucket(b'[["w", "float32", [4.5]]]', 16), "is not [name, dtype"),
    "unknown dtype": (bucket([["w", "float99", [4]]], 16), "unknown dtype name 'float99'"),
    "byte count mismatch": (bucket([["w", "float32", [4]]], 999), "does not match its metadata"),
    "unallocatable size": (bucket([["w", "float32", [2**30, 2**30]]]), "cannot allocate"),
    "truncated stream": (bucket([[NORM, "float32", [128]]]), "CollectiveTimeout"),
    "unknown parameter": (whole_update("nope.weight", "float32", torch.ones(4)), "is not a parameter"),
    "wrong shape": (whole_update(NORM, "float32", torch.ones(3)), "has shape (3,), expected (128,)"),
    "integer weights": (whole_update(NORM, "int32", torch.ones(128, dtype=torch.int32)), "floating-point"),
    "non-finite weights": (whole_update(NORM, "float32", torch.full((128,), float("nan"))), "non-finite"),
}


def open_group(server: ThreadServer, timeout_s: float) -> TransferGroup:
    """Rank 0 of a fresh group "bad" that the server joins as rank 1."""
    store = host_store("127.0.0.1", 2, init_timeout_s=30)
    info = {
        **GOOD_INIT,
        "master_port": store.port,
        "group": "bad",
        "init_timeout_s": 30,
        "timeout_s": timeout_s,
    }
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(
            httpx.post,
            server.url + "/init_weight_transfer_engine",
            json={"init_info": info},
            headers=CONTROL,
            timeout=60,
        )
        group = TransferGroup.create(
            master_address="127.0.0.1",
            master_port=store.port,
            rank=0,
            world_size=2,
            backend="gloo",
            group_name="bad",
            init_timeout_s=30,
            timeout_s=30,
            store=store,
        )
        assert joined.result().status_code == 200, joined.result().text
    return group


@pytest.mark.parametrize("case", list(STREAMS))
def test_malformed_weight_streams_are_4xx_and_a_valid_update_follows(server, hf_models, case):
    pieces, needle = STREAMS[case]
    before = httpx.get(server.url + "/weight_info", headers=CONTROL).json()
    group = open_group(server, timeout_s=2)
    try:
        assert httpx.post(server.url + "/start_weight_update", headers=CONTROL).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                httpx.post,
                server.url + "/update_weights",
                json={"update_info": {"group": "bad", "version": "bad"}},
                headers=CONTROL,
                timeout=60,
            )
            for piece in pieces:
                group.broadcast(piece)
            if pieces[-1] is END:  # a complete stream: the server reports, as to a trainer
                (report,) = group.gather(WorkerReport.empty_tensor(torch.device("cpu")))[1:]
                assert WorkerReport.from_tensor(report).params_loaded == 0
            response = answer.result()
    finally:
        group.shutdown()
    assert_refused_and_harmless(server, response, needle)
    assert httpx.get(server.url + "/weight_info", headers=CONTROL).json() == before  # nothing written
    sender = WeightSender(
        [server.ref], WeightSyncSettings(control_token=TEST_CONTROL_TOKEN, init_timeout_s=30, timeout_s=30)
    )
    version = list(STREAMS).index(case) + 1
    try:
        sender.push(iter_buckets(hf_models[0].named_parameters(), 1 << 20), version=version)
    finally:
        sender.close()
    assert httpx.get(server.url + "/weight_info", headers=CONTROL).json() == {"weight_version": str(version)}
