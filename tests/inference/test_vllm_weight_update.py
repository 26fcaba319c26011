"""In-place weight updates of a running vLLM CPU server through refractor's transfer backend:
the served model really changes (tied embeddings included, the vLLM CPU bug), versions are
reported, the canary catches corruption, a bad update is rejected whole, and an in-flight request
switches versions mid-way."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from functools import partial

import httpx
import pytest
import torch
from inflight_push import TOKENS_BEFORE_PUSH, stream_while_pushing

from refractor.inference.client import InferenceClient
from refractor.testing import TEST_CONTROL_TOKEN
from refractor.weight_sync import WeightSyncError
from refractor.weight_sync.buckets import iter_buckets
from refractor.weight_sync.sender import CanaryError

CONTROL = {"Authorization": f"Bearer {TEST_CONTROL_TOKEN}"}  # the control routes' credential

pytestmark = pytest.mark.vllm
PROMPT = list(range(3, 40))


def sample(url: str, n: int = 4, max_tokens: int = 16, seed: int = 0) -> list[tuple[list[int], torch.Tensor]]:
    response = httpx.post(
        url + "/v1/completions",
        timeout=120,
        json={
            "model": "tiny",  # the session server's served_model_name
            "prompt": PROMPT,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "logprobs": 0,
            "return_token_ids": True,
            "ignore_eos": True,
            "seed": seed,
        },
    ).json()
    return [
        (c["token_ids"], torch.tensor(c["logprobs"]["token_logprobs"], dtype=torch.float64))
        for c in response["choices"]
    ]


@pytest.fixture
def max_error(hf_token_logprobs):
    def worst(samples, model) -> float:
        return max(
            (logprobs - hf_token_logprobs(model, PROMPT, tokens)).abs().max().item()
            for tokens, logprobs in samples
        )

    return worst


def test_push_switches_the_served_weights_both_ways(vllm_server, vllm_sender, hf_models, max_error):
    for version, (new, old) in enumerate(((1, 0), (0, 1)), start=10):
        result = vllm_sender.push(iter_buckets(hf_models[new].named_parameters(), 256 << 10), version=version)
        (report,) = result.reports["vllm-0"]
        assert report.params_loaded == report.params_total > 0 and report.checksum == result.stats.checksum
        assert result.stats.buckets > 1  # 256 KiB buckets: the 1.4 MB model travels in several
        assert httpx.get(vllm_server.url + "/weight_info", headers=CONTROL).json() == {
            "weight_version": str(version)
        }
        samples = sample(vllm_server.url, seed=version)
        assert max_error(samples, hf_models[new]) < 1e-4  # exact in fp32, tied lm_head refreshed
        assert max_error(samples, hf_models[old]) > 0.05  # and it is not the previous model


def test_the_sleep_cycle_of_a_colocated_run(vllm_server, vllm_sender, hf_models, max_error):
    """What the driver asks of a sleeping vLLM server each step (refractor's client, vLLM's routes):
    sleep, wake the weights, a weight update (canary checked), wake the KV cache, generate."""
    client = InferenceClient(vllm_server.url, control_token=TEST_CONTROL_TOKEN)

    async def asleep_then_awake() -> tuple[bool, bool]:
        await client.sleep(1, "wait")
        asleep = await client.is_sleeping()
        await client.wake_up(["weights"])
        await asyncio.to_thread(
            vllm_sender.push, iter_buckets(hf_models[1].named_parameters(), 256 << 10), 30
        )
        await client.wake_up(["kv_cache"])
        awake = not await client.is_sleeping()
        await client.close()
        return asleep, awake

    assert asyncio.run(asleep_then_awake()) == (True, True)
    assert max_error(sample(vllm_server.url, seed=30), hf_models[1]) < 1e-4


def test_corrupted_bucket_fails_the_canary(vllm_server, vllm_sender, hf_models, max_error):
    with pytest.raises(CanaryError, match=r"server 'vllm-0' \(rank 1\): received checksum"):
        vllm_sender.push(
            iter_buckets(hf_models[1].named_parameters(), 1 << 20), version=20, _corrupt_for_test=True
        )
    # the server stays usable: the next good push repairs it
    vllm_sender.push(iter_buckets(hf_models[1].named_parameters(), 1 << 20), version=21)
    assert max_error(sample(vllm_server.url, n=2, seed=21), hf_models[1]) < 1e-4


def _unknown_name(params):
    return [*params, ("model.layers.1.mlp.not_a_weight", torch.zeros(8))]


def _wrong_shape(params):
    (name, _) = params[-1]
    return [*params[:-1], (name, torch.ones(64))]


def _nan(params):
    (name, tensor) = params[-1]
    return [*params[:-1], (name, torch.full_like(tensor, float("nan")))]


@pytest.mark.parametrize(
    ("spoil", "error"),
    [
        (_unknown_name, r"not a tensor of the served checkpoint: 'model\.layers\.1\.mlp\.not_a_weight'"),
        (_wrong_shape, r"wrong shape: 'model\.norm\.weight' \(64,\) \(expected \(128,\)\)"),
        (_nan, r"non-finite values \(NaN or Inf\): 'model\.norm\.weight'"),
    ],
    ids=["unknown-name", "wrong-shape", "nan"],
)
def test_a_bad_push_is_rejected_whole(spoil, error, vllm_server, vllm_sender, hf_models, max_error):
    """The bad tensor comes last, after buckets that hold whole valid layers of another model: nothing
    of the update may be served, and the version stays."""
    vllm_sender.push(iter_buckets(hf_models[0].named_parameters(), 256 << 10), version=60)
    before = sample(vllm_server.url, n=2, seed=60)
    params = [(name, p.detach()) for name, p in hf_models[1].named_parameters()]
    with pytest.raises(WeightSyncError, match=r"weight update rejected, nothing was written.*" + error):
        vllm_sender.push(iter_buckets(spoil(params), 256 << 10), version=61)
    assert httpx.get(vllm_server.url + "/weight_info", headers=CONTROL).json() == {"weight_version": "60"}
    assert httpx.get(vllm_server.url + "/is_paused", headers=CONTROL).json() == {"is_paused": False}
    after = sample(vllm_server.url, n=2, seed=60)
    assert [tokens for tokens, _ in after] == [tokens for tokens, _ in before]
    assert max_error(after, hf_models[0]) < 1e-4
    # the server takes the next good update
    result = vllm_sender.push(iter_buckets(params, 256 << 10), version=62)
    (report,) = result.reports["vllm-0"]
    assert report.params_loaded == report.params_total > 0
    assert max_error(sample(vllm_server.url, n=2, seed=62), hf_models[1]) < 1e-4


@pytest.mark.parametrize("inflight_kv", ["recompute", "keep"])
def test_update_during_an_inflight_request(
    inflight_kv,
    vllm_server,
    vllm_sender,
    vllm_model_name,
    hf_models,
    hf_token_logprobs,
    stale_kv_logprobs,
    monkeypatch,
):
    monkeypatch.setattr(
        vllm_sender, "settings", dataclasses.replace(vllm_sender.settings, inflight_kv=inflight_kv)
    )
    first = 30 if inflight_kv == "recompute" else 40
    # Where the update lands is up to the scheduler: on a loaded machine the request can finish before
    # the push arrives. That is not a failure of the update, so such an attempt is repeated (3 at most),
    # then the test is skipped, saying so.
    for attempt in range(3):
        old_version = first + 2 * attempt
        vllm_sender.push(iter_buckets(hf_models[0].named_parameters(), 1 << 20), version=old_version)
        streamed = stream_while_pushing(
            vllm_server.url,
            vllm_model_name,
            PROMPT,
            partial(
                vllm_sender.push, iter_buckets(hf_models[1].named_parameters(), 1 << 20), old_version + 1
            ),
            max_tokens=450,
            seed=5,
        )
        if streamed.switched_versions:
            break
    else:  # the tiny model outran the client three times (busy cores): the condition was not provoked
        pytest.skip(
            f"{inflight_kv}: the request finished before the update landed in 3 attempts "
            f"(spans {streamed.weight_versions})"
        )
    spans = streamed.weight_versions
    old_v = str(old_version)
    new_v = str(old_version + 1)
    assert [s["version"] for s in spans] == [old_v, new_v], spans
    switch = spans[0]["end"]
    assert spans[0]["start"] == 0 and spans[1] == {"version": new_v, "start": switch, "end": 450}
    assert TOKENS_BEFORE_PUSH <= switch < 450
    logprobs = torch.tensor(streamed.logprobs, dtype=torch.float64)
    old = hf_token_logprobs(hf_models[0], PROMPT, streamed.tokens)
    new = hf_token_logprobs(hf_models[1], PROMPT, streamed.tokens)
    assert (logprobs[:switch] - old[:switch]).abs().max() < 1e-4  # tokens before the switch: the old model
    if inflight_kv == "recompute":  # after it, the new model on the full sequence (KV recomputed)
        assert (logprobs[switch:] - new[switch:]).abs().max() < 1e-4
    else:  # after it, the new weights over the old-weight KV (the same as the native engine)
        stale = stale_kv_logprobs(hf_models[0], hf_models[1], PROMPT, streamed.tokens, switch)
        assert (logprobs[switch:] - stale).abs().max() < 1e-4
        assert (logprobs[switch:] - new[switch:]).abs().max() > 1e-2


def test_the_expected_tensors_come_from_the_checkpoint_index_or_are_not_checked(tmp_path, caplog):
    """Sharded checkpoints: the files the index lists (a consolidated copy beside them is ignored).
    No safetensors file: a warning, and only dtypes and finiteness are checked."""
    from safetensors.torch import save_file

    from refractor.inference.vllm.update_check import (
        ExpectedTensor,
        expected_update_tensors,
        update_problems,
    )

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a.weight": torch.zeros(2, 3)}, sharded / "model-1.safetensors")
    save_file({"b.ids": torch.zeros(4, dtype=torch.int64)}, sharded / "model-2.safetensors")
    save_file({"consolidated.weight": torch.zeros(1)}, sharded / "consolidated.safetensors")
    index = {"weight_map": {"a.weight": "model-1.safetensors", "b.ids": "model-2.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    expected = expected_update_tensors(str(sharded), None, None, tied_lm_head_shape=(5, 3))
    assert expected == {
        "a.weight": ExpectedTensor((2, 3), True),
        "b.ids": ExpectedTensor((4,), False),
        "lm_head.weight": ExpectedTensor((5, 3), True),
    }
    valid = [("a.weight", torch.ones(2, 3)), ("b.ids", torch.ones(4, dtype=torch.int64))]
    assert update_problems(valid, expected) == []
    assert update_problems([("b.ids", torch.ones(4)), ("lm_head.weight", torch.ones(5, 3))], expected) == [
        "wrong kind of dtype (floating point vs integer): 'b.ids' torch.float32"
    ]

    empty = tmp_path / "no-safetensors"
    empty.mkdir()
    with caplog.at_level("WARNING"):
        assert expected_update_tensors(str(empty), None, None, tied_lm_head_shape=None) is None
    assert "not for names and shapes" in caplog.text
    assert update_problems([("any.name", torch.ones(7))], None) == []
    bad = [("x", torch.tensor([1.0, float("inf")])), ("y", torch.ones(2, dtype=torch.int32))]
    assert update_problems(bad, None) == [
        "wrong kind of dtype (floating point vs integer): 'y' torch.int32",
        "non-finite values (NaN or Inf): 'x'",
    ]
