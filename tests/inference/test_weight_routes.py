"""The weight-update contract on the native engine: the same WeightSender that updates vLLM
updates refractor's engine through ``weight_update_router``. Servers are the real native server
(``refractor.inference.server``, which mounts the router) around a real ``AsyncLLMEngine``: served
by uvicorn from a thread of this process, or run in a subprocess when the test has to kill one."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from native_thread_server import PROMPT, ThreadServer

from refractor.inference.engine import SamplingParams
from refractor.inference.vllm.launcher import free_port
from refractor.testing import TEST_CONTROL_TOKEN
from refractor.weight_sync.buckets import iter_buckets
from refractor.weight_sync.control_plane import ServerRef, WeightSyncError
from refractor.weight_sync.records import UpdateTarget
from refractor.weight_sync.sender import CanaryError, WeightSender
from refractor.weight_sync.settings import WeightSyncSettings

CONTROL = {"Authorization": f"Bearer {TEST_CONTROL_TOKEN}"}  # the control routes' credential


@pytest.fixture(scope="module")
def qwen_servers(tiny_qwen2_path):
    servers = [ThreadServer("train-0", tiny_qwen2_path), ThreadServer("eval-0", tiny_qwen2_path)]
    yield servers
    for server in servers:
        server.stop()


def worst_error(outputs, model, hf_token_logprobs) -> float:
    return max(
        (torch.tensor(o.logprobs, dtype=torch.float64) - hf_token_logprobs(model, PROMPT, o.token_ids))
        .abs()
        .max()
        .item()
        for o in outputs
    )


def check_phase_spans(result, before: float, after: float) -> None:
    """The push's phases, in order, inside the push, each bucket gathered then sent."""
    spans = {}
    for e in result.spans:
        assert e.name.startswith("weight_sync/") and e.component == "trainer"
        assert before <= e.start <= e.end <= after, e
        spans.setdefault(e.name.removeprefix("weight_sync/"), []).append(e)
    assert set(spans) == {"gather_ahead", "pause", "server", "gather", "send", "drain", "finish", "resume"}
    sends = spans["send"]
    assert (
        [e.attrs["bucket"] for e in sends]
        == list(range(len(sends)))
        == [e.attrs["bucket"] for e in spans["gather"]]
    )
    assert sum(e.attrs["bytes"] for e in sends) == result.stats.bytes and len(sends) > 1
    assert spans["pause"][0].end <= sends[0].start and sends[-1].end <= spans["drain"][0].end
    assert spans["drain"][0].end <= spans["finish"][0].start <= spans["resume"][0].start
    assert sorted(e.attrs["server"] for e in spans["server"]) == sorted(result.reports)
    for e in spans["server"]:  # each server's workers reported how long they received and loaded
        worker = result.reports[e.attrs["server"]][0]
        assert e.attrs["load_seconds"] == worker.load_us / 1e6 > 0
        assert e.attrs["receive_seconds"] == worker.receive_us / 1e6 > 0


def test_full_and_training_only_targets(qwen_servers, hf_models, hf_token_logprobs):
    train, evaluation = qwen_servers
    sender = WeightSender(
        [train.ref, evaluation.ref],
        WeightSyncSettings(control_token=TEST_CONTROL_TOKEN, init_timeout_s=30, timeout_s=30),
        eval_servers={"eval-0"},
    )
    try:
        before = time.time()
        result = sender.push(iter_buckets(hf_models[1].named_parameters(), 300 << 10), version=5)
        check_phase_spans(result, before, time.time())
        assert sorted(result.reports) == ["eval-0", "train-0"]
        assert all(r.params_loaded == r.params_total > 0 for rs in result.reports.values() for r in rs)
        for server in qwen_servers:
            assert httpx.get(server.url + "/weight_info", headers=CONTROL).json() == {"weight_version": "5"}
            outputs = server.generate(seed=1)
            assert worst_error(outputs, hf_models[1], hf_token_logprobs) < 1e-4
            assert worst_error(outputs, hf_models[0], hf_token_logprobs) > 0.05
            assert all(o.weight_versions[0].version == "5" for o in outputs)
        # eval servers keep the previous version while training continues on the others
        result = sender.push(
            iter_buckets(hf_models[0].named_parameters(), 300 << 10),
            version=6,
            target=UpdateTarget.TRAINING_ONLY,
        )
        assert list(result.reports) == ["train-0"] and result.stats.metadata_sent  # its own group
        assert httpx.get(train.url + "/weight_info", headers=CONTROL).json() == {"weight_version": "6"}
        assert httpx.get(evaluation.url + "/weight_info", headers=CONTROL).json() == {"weight_version": "5"}
        assert worst_error(train.generate(), hf_models[0], hf_token_logprobs) < 1e-4
        assert worst_error(evaluation.generate(), hf_models[1], hf_token_logprobs) < 1e-4
    finally:
        sender.close()


def test_corrupted_bucket_fails_the_canary(qwen_servers, hf_models, hf_token_logprobs):
    train, _ = qwen_servers
    sender = WeightSender(
        [train.ref], WeightSyncSettings(control_token=TEST_CONTROL_TOKEN, init_timeout_s=30, timeout_s=30)
    )
    try:
        with pytest.raises(CanaryError, match=r"server 'train-0' \(rank 1\): received checksum"):
            sender.push(
                iter_buckets(hf_models[1].named_parameters(), 1 << 20), version=7, _corrupt_for_test=True
            )
        sender.push(iter_buckets(hf_models[1].named_parameters(), 1 << 20), version=8)
        assert worst_error(train.generate(), hf_models[1], hf_token_logprobs) < 1e-4
    finally:
        sender.close()


@pytest.mark.parametrize("inflight_kv", ["recompute", "keep"])
def test_update_during_an_inflight_request(
    inflight_kv, qwen_servers, hf_models, hf_token_logprobs, stale_kv_logprobs
):
    train, _ = qwen_servers
    sender = WeightSender(
        [train.ref],
        WeightSyncSettings(
            control_token=TEST_CONTROL_TOKEN, init_timeout_s=30, timeout_s=30, inflight_kv=inflight_kv
        ),
    )
    try:
        sender.push(iter_buckets(hf_models[0].named_parameters(), 1 << 20), version=10)
        before = train.engine.stats().generation_tokens_total
        result: dict = {}
        params = SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True, seed=4)
        request = threading.Thread(
            target=lambda: result.update(output=asyncio.run(train.engine.generate(PROMPT, params)).outputs[0])
        )
        request.start()
        deadline = time.monotonic() + 60
        while train.engine.stats().generation_tokens_total < before + 20:  # decoding has begun
            assert time.monotonic() < deadline
            time.sleep(0.005)
        preemptions = train.engine.stats().num_preemptions_total
        sender.push(iter_buckets(hf_models[1].named_parameters(), 1 << 20), version=11)
        preempted = train.engine.stats().num_preemptions_total - preemptions
        request.join(60)
        output = result["output"]
        spans = [(s.version, s.start, s.end) for s in output.weight_versions]
        assert len(output.token_ids) == 200 and [s[0] for s in spans] == ["10", "11"], spans
        switch = spans[0][2]
        assert spans == [("10", 0, switch), ("11", switch, 200)] and 20 <= switch < 200
        logprobs = torch.tensor(output.logprobs, dtype=torch.float64)
        old = hf_token_logprobs(hf_models[0], PROMPT, output.token_ids)
        new = hf_token_logprobs(hf_models[1], PROMPT, output.token_ids)
        assert (logprobs[:switch] - old[:switch]).abs().max() < 1e-4
        if inflight_kv == "recompute":  # KV re-prefilled with the new weights: exactly the new policy
            assert preempted == 1
            assert (logprobs[switch:] - new[switch:]).abs().max() < 1e-4
        else:  # the old-weight KV stays: new weights over it, which is neither policy
            assert preempted == 0
            stale = stale_kv_logprobs(hf_models[0], hf_models[1], PROMPT, output.token_ids, switch)
            assert (logprobs[switch:] - stale).abs().max() < 1e-4
            assert (logprobs[switch:] - new[switch:]).abs().max() > 1e-2
    finally:
        sender.close()


def test_untied_model_per_tensor_mode(tiny_llama_path, hf_token_logprobs):
    from transformers import AutoModelForCausalLM

    from refractor.testing import tiny_llama

    new = AutoModelForCausalLM.from_pretrained(tiny_llama(seed=3), dtype=torch.float32).eval()
    server = ThreadServer("llama-0", tiny_llama_path)
    settings = WeightSyncSettings(
        control_token=TEST_CONTROL_TOKEN, broadcast_mode="per_tensor", init_timeout_s=30, timeout_s=30
    )
    sender = WeightSender([server.ref], settings)
    try:
        result = sender.push(iter_buckets(new.named_parameters(), 1 << 20), version=1)
        (report,) = result.reports["llama-0"]
        assert (
            report.tensors == len(list(new.named_parameters()))
            and report.params_loaded == report.params_total
        )
        assert worst_error(server.generate(), new, hf_token_logprobs) < 1e-4
    finally:
        sender.close()
        server.stop()


SUBPROCESS_SERVER = """
import sys
from refractor.inference.engine import EngineConfig
from refractor.inference.server import run_native_server
config = EngineConfig(
    max_model_len=256, max_num_seqs=2, kv_cache_memory_gb=0.01, dtype="float32", device="cpu"
)
run_native_server(sys.argv[1], "127.0.0.1", int(sys.argv[2]), control_token=sys.argv[3], engine_config=config)
"""


@pytest.mark.parametrize("failure", ["dies", "hangs"])
def test_a_server_failing_mid_update_is_named_in_bounded_time(failure, tiny_qwen2_path, hf_models):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", SUBPROCESS_SERVER, str(tiny_qwen2_path), str(port), TEST_CONTROL_TOKEN],
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "the native server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        # no gather-ahead: buckets stream while the server receives, so the failure lands mid-update
        settings = WeightSyncSettings(
            control_token=TEST_CONTROL_TOKEN, init_timeout_s=30, timeout_s=3, gather_before_pause_bytes=0
        )
        sender = WeightSender([ServerRef("doomed-0", url)], settings)

        all_buckets = list(iter_buckets(hf_models[1].named_parameters(), 64 << 10))
        consumed = []

        def buckets_then_failure():
            for i, bucket in enumerate(all_buckets):
                if i == 2:  # the server is receiving this update right now
                    os.killpg(process.pid, signal.SIGKILL if failure == "dies" else signal.SIGSTOP)
                    time.sleep(0.2)
                consumed.append(i)
                yield bucket

        start = time.monotonic()
        reason = "unreachable" if failure == "dies" else "no answer to /health"
        with pytest.raises(WeightSyncError, match=rf"server doomed-0 \({url}\): {reason}"):
            sender.push(buckets_then_failure(), version=1)
        assert time.monotonic() - start < 3 + 5 + 10  # collective timeout + /health probe + slack
        # the failed push still consumed every bucket: lockstep trainer ranks are not left hanging
        assert consumed == list(range(len(all_buckets)))
        sender.close()
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_the_inflight_kv_key_reaches_the_sender():
    from pathlib import Path

    from refractor.config import ConfigError, load_config

    quickstart = Path(__file__).resolve().parents[2] / "configs" / "examples" / "quickstart.yaml"
    servers = [ServerRef("server-0", "http://127.0.0.1:9")]
    for value in ("recompute", "keep"):
        settings = WeightSyncSettings.from_config(load_config(quickstart, {"weight_sync_inflight_kv": value}))
        sender = WeightSender(servers, settings)
        assert sender.settings.inflight_kv == value
        sender.close()
    with pytest.raises(ConfigError, match="weight_sync_inflight_kv"):
        load_config(quickstart, {"weight_sync_inflight_kv": "stale"})
    with pytest.raises(ValueError, match="inflight_kv must be 'recompute' or 'keep', got 'stale'"):
        WeightSyncSettings(control_token=TEST_CONTROL_TOKEN, inflight_kv="stale")
