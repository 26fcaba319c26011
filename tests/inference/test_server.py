"""The native server as a real subprocess: OpenAI shapes (openai client), vLLM generate shape,
400s, metrics, control routes, client-disconnect abort; with the engine in the server's process and
in a process of its own."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import httpx
import psutil
import pytest
import torch
from metrics_wait import wait_for_metric

from refractor.inference.client import summed_samples
from refractor.inference.native_launcher import start_native_server
from refractor.testing import TEST_CONTROL_TOKEN

CONTROL = {"Authorization": f"Bearer {TEST_CONTROL_TOKEN}"}  # the control routes' credential

MODEL = "tiny"


def _start(model_path, engine_process: bool):
    return start_native_server(
        str(model_path),
        control_token=TEST_CONTROL_TOKEN,
        served_model_name=MODEL,
        engine_args={
            "max_model_len": 512,
            "kv_cache_memory_gb": 0.05,
            "block_size": 16,
            "engine_process": engine_process,
        },
    )


@pytest.fixture(scope="module")
def engine_thread_server(tiny_qwen2_path):
    handle = _start(tiny_qwen2_path, engine_process=False)
    yield handle
    handle.stop()
    assert not handle.alive()


@pytest.fixture(scope="module")
def engine_process_server(tiny_qwen2_path):
    handle = _start(tiny_qwen2_path, engine_process=True)
    first = handle.log_path.read_text().splitlines()[0]
    engine = psutil.Process(int(re.search(r"engine process (\d+)", first).group(1)))
    yield handle
    # the server dies without running its shutdown path: its engine process still ends
    os.kill(handle.process.pid, signal.SIGKILL)
    try:
        engine.wait(timeout=10)
    finally:
        handle.stop()
    assert not handle.alive() and not engine.is_running()


@pytest.fixture(params=["engine_thread_server", "engine_process_server"])
def server(request):
    """The same contract with the engine in the server's process or in one of its own."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def hf(tiny_qwen2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, dtype=torch.float32).eval()


def _teacher_forced(hf, prompt, completion, temperature=1.0):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = (hf(ids).logits[0, len(prompt) - 1 : -1].double() / temperature).log_softmax(-1)
    return logp.gather(1, torch.tensor(completion)[:, None])[:, 0]


def _metrics(url: str) -> dict[str, float]:
    return summed_samples(httpx.get(url + "/metrics").text)


def test_openai_client_completions_and_chat(server, hf, tiny_qwen2_path):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [MODEL]
    prompt = [5, 17, 33, 90, 2]
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=6,
        n=2,
        temperature=0.8,
        seed=3,
        logprobs=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert out.object == "text_completion" and len(out.choices) == 2
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 12
    for choice in out.choices:
        token_ids = choice.model_extra["token_ids"]
        assert choice.model_extra["prompt_token_ids"] == prompt and choice.finish_reason == "length"
        assert len(token_ids) == 6 == len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens)
        ref = _teacher_forced(hf, prompt, token_ids, 0.8)
        assert (torch.tensor(choice.logprobs.token_logprobs, dtype=torch.float64) - ref).abs().max() <= 1e-4
    batch = client.completions.create(
        model=MODEL,
        prompt=["Hello there", "The answer is"],
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in batch.choices] == [0, 1] and all(isinstance(c.text, str) for c in batch.choices)

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is 2 + 2?"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        temperature=1.0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2_path)
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.model_extra["prompt_token_ids"] == tok(rendered, add_special_tokens=False).input_ids
    with pytest.raises(Exception, match="does not exist"):
        client.completions.create(model="other", prompt=[1, 2], max_tokens=1)


def test_generate_endpoint_matches_vllm_shape(server, hf):
    prompt = [9, 8, 7, 6]
    body = {
        "model": MODEL,
        "token_ids": prompt,
        "request_id": "g1",
        "return_token_ids": True,
        "sampling_params": {
            "n": 2,
            "temperature": 1.0,
            "max_tokens": 7,
            "logprobs": 0,
            "seed": 1,
            "ignore_eos": True,
        },
    }
    data = httpx.post(server.url + "/inference/v1/generate", json=body).json()
    assert data["request_id"] == "g1" and data["prompt_token_ids"] == prompt
    for choice in data["choices"]:
        assert sorted(choice) == [
            "finish_reason",
            "index",
            "logprobs",
            "routed_experts",
            "sampling_mask",
            "stop_reason",
            "token_ids",
            "weight_versions",
        ]
        assert choice["weight_versions"] == [{"version": "0", "start": 0, "end": 7}]
        content = choice["logprobs"]["content"]
        assert [c["token_id"] for c in content] == choice["token_ids"]
        assert all(c["top_logprobs"][0]["token_id"] == c["token_id"] and c["rank"] >= 1 for c in content)
        ref = _teacher_forced(hf, prompt, choice["token_ids"])
        assert (torch.tensor([c["logprob"] for c in content], dtype=torch.float64) - ref).abs().max() <= 1e-4
    again = httpx.post(server.url + "/inference/v1/generate", json={**body, "request_id": "g2"}).json()
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in data["choices"]]  # seeded
    # the engine's account of the request's time: its phases add up
    t = data["latency"]
    assert sorted(t) == ["decode_time", "e2e_latency", "prefill_time", "queue_time", "ttft"]
    assert min(t.values()) >= 0 and t["decode_time"] > 0
    assert t["ttft"] == pytest.approx(t["queue_time"] + t["prefill_time"], abs=1e-9)
    assert t["e2e_latency"] == pytest.approx(t["ttft"] + t["decode_time"], abs=1e-9)


@pytest.mark.parametrize(
    "path,body,needle",
    [
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": [1, 2], "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": [1, 2], "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": list(range(3, 600))}, "max_model_len"),
        ("/v1/completions", {"prompt": [1, 100000]}, "token ids"),
        ("/v1/completions", {"prompt": [1, 2], "stream": True, "logprobs": 1}, "not streamed"),
        ("/v1/completions", {"prompt": [1, 2], "echo": True, "logprobs": 1}, "echo with logprobs"),
        ("/v1/completions", {"prompt": list(range(3, 600)), "stream": True}, "max_model_len"),
        ("/v1/completions", {"prompt": [1, 2], "presence_penalty": 1.0}, "presence_penalty"),
        ("/inference/v1/generate", {"token_ids": [-1, 2]}, "negative"),
        ("/inference/v1/generate", {"token_ids": []}, "token_ids"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/pause?mode=sideways", None, "mode"),
        ("/v1/completions", {"prompt": [1, 2], "top_k": 2**63}, "top_k"),
        ("/v1/completions", {"prompt": [1, 2], "seed": 2**70}, "seed"),
        ("/v1/completions", {"prompt": [1, 2], "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": [1, 2], "stop_token_ids": [-1]}, "stop_token_ids"),
        ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"top_k": 2**40}}, "top_k"),
        ("/v1/completions", {"prompt": "hi \ud800 there", "max_tokens": 2}, "not valid Unicode"),
        ("/v1/completions", {"prompt": "ok", "stop": ["\udfff"]}, "stop: text is not valid Unicode"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "content: text"),
        ("/tokenize", {"prompt": "\ud800"}, "not valid Unicode"),
        ("/abort_requests", {"request_ids": 5}, "request_ids"),
        ("/abort_requests", {"request_ids": [None]}, "request_ids.0"),
        ("/abort_requests", [1, 2], "body"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 511}, "max_tokens (511) is too large"),
        (
            "/inference/v1/generate",
            {"token_ids": [1], "sampling_params": {"max_tokens": 600}},
            "room for 511",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6},
            "max_tokens (1000000) is too large",
        ),
        ("/v1/completions", {"prompt": [1, 2], "temperature": 1e-40, "logprobs": 1}, "temperature"),
    ],
)
def test_bad_requests_are_400_and_harmless(server, path, body, needle):
    # json.dumps escapes lone surrogates as \\udXXX, as a client in any language can send them
    content = b"null" if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json", **CONTROL}
    response = httpx.post(server.url + path, content=content, headers=headers)
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"] and "Traceback" not in response.text
    for route in ("/v1/completions", "/abort_requests"):
        malformed = httpx.post(server.url + route, content=b"{oops", headers=headers)
        assert malformed.status_code == 400, (route, malformed.text)
    assert httpx.get(server.url + "/health").status_code == 200


def test_an_out_of_range_request_among_concurrent_ones_fails_alone(server):
    """A top_k beyond int64 used to pass validation and crash the engine step: every request of the
    batch got a 500. It is refused before it joins a batch now; the 20 others all finish."""

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            good = [
                client.post(
                    "/v1/completions", json={"prompt": [1, 2, i + 3], "max_tokens": 8, "ignore_eos": True}
                )
                for i in range(20)
            ]
            bad = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 8, "top_k": 2**63})
            return await asyncio.gather(bad, *good)

    bad, *good = asyncio.run(main())
    assert bad.status_code == 400 and "top_k" in bad.json()["error"]["message"]
    assert [r.status_code for r in good] == [200] * 20
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in good)


def test_metrics_pause_abort_and_disconnect(server):
    url = server.url
    long = {"prompt": [1, 2, 3], "max_tokens": 480, "ignore_eos": True, "n": 2}
    # Client disconnect (timeout) aborts the request. The engine is paused first, so the request
    # cannot finish before the client leaves however fast the machine is.
    assert httpx.post(url + "/pause", params={"mode": "keep"}, headers=CONTROL).status_code == 200
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=long, timeout=0.5)
        wait_for_metric(url, "vllm:num_requests_waiting", lambda n: n == 0)
    finally:  # the server is shared by the module's tests
        httpx.post(url + "/resume", headers=CONTROL)
    metrics = _metrics(url)
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0

    # /abort_requests by the caller's request id: partial tokens come back with finish_reason abort.
    # Frozen in flight (pause keep) once it runs, so it is still there when the abort comes.
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(
            r=httpx.post(url + "/v1/completions", json={**long, "request_id": "to-abort"}, timeout=30).json()
        )
    )
    worker.start()
    wait_for_metric(url, "vllm:num_requests_running", lambda n: n >= 1)
    assert httpx.post(url + "/pause", params={"mode": "keep"}, headers=CONTROL).status_code == 200
    try:
        aborted = httpx.post(url + "/abort_requests", json={"request_ids": ["to-abort"]}, headers=CONTROL)
        assert aborted.json()["aborted"] == 1
    finally:
        httpx.post(url + "/resume", headers=CONTROL)
    worker.join(10)
    assert {c["finish_reason"] for c in result["r"]["choices"]} == {"abort"}
    assert 0 < result["r"]["usage"]["completion_tokens"] < 960

    # pause(keep) freezes, resume continues; is_paused reflects it.
    worker = threading.Thread(
        target=lambda: result.update(
            k=httpx.post(url + "/v1/completions", json={**long, "max_tokens": 200}, timeout=30).json()
        )
    )
    worker.start()
    time.sleep(0.2)
    assert httpx.post(url + "/pause", params={"mode": "keep"}, headers=CONTROL).json() == {"status": "paused"}
    assert httpx.get(url + "/is_paused", headers=CONTROL).json() == {"is_paused": True}
    try:
        frozen = _metrics(url)["vllm:generation_tokens_total"]
        time.sleep(0.2)
        assert _metrics(url)["vllm:generation_tokens_total"] == frozen
    finally:
        httpx.post(url + "/resume", headers=CONTROL)
    worker.join(20)
    assert {c["finish_reason"] for c in result["k"]["choices"]} == {"length"}
    assert httpx.post(url + "/abort_requests", json={}, headers=CONTROL).json()["aborted"] == 0
    metrics = _metrics(url)
    assert (
        metrics["vllm:generation_tokens_total"] > 0 and metrics["vllm:e2e_request_latency_seconds_count"] >= 1
    )


def test_stop_strings_cut_the_text(server):
    body = {
        "prompt": "The quick brown fox",
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 0,
        "ignore_eos": True,
    }
    free = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]["text"]
    start = next(
        i for i in range(4, len(free) - 1) if free[i : i + 2].isascii() and free[i : i + 2].isalnum()
    )
    stop = free[start : start + 2]
    choice = httpx.post(server.url + "/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["text"] == free[: free.index(stop)]


def test_app_seams_chat_template_and_extra_routers(tiny_qwen2_path):
    """In process: a configured chat template replaces the tokenizer's; extra routers are mounted."""
    import asyncio

    from fastapi import APIRouter
    from transformers import AutoTokenizer

    from refractor.inference.engine import EngineConfig, LLMEngine
    from refractor.inference.engine.async_engine import AsyncLLMEngine
    from refractor.inference.server import create_app

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_path)
    engine = AsyncLLMEngine(
        LLMEngine.from_pretrained(tiny_qwen2_path, EngineConfig(max_model_len=128, kv_cache_memory_gb=0.01))
    )
    extra = APIRouter()

    @extra.get("/engine_version")
    async def engine_version():
        return {"weight_version": str(engine.weight_version)}

    app = create_app(
        engine,
        tokenizer,
        "t",
        chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}",
        control_token=TEST_CONTROL_TOKEN,
        extra_routers=[extra],
    )

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            tokens = (
                await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
            ).json()
            chat = (
                await client.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 2,
                        "return_token_ids": True,
                    },
                )
            ).json()
            info = (await client.get("/engine_version", headers=CONTROL)).json()
        return tokens, chat, info

    try:
        tokens, chat, info = asyncio.run(main())
    finally:
        engine.shutdown()
    assert tokens["tokens"] == tokenizer("[hi]", add_special_tokens=False).input_ids
    assert chat["prompt_token_ids"] == tokens["tokens"]
    assert info == {"weight_version": "0"}


def test_health_answers_while_a_huge_prompt_is_tokenized(engine_thread_server):
    """Tokenization runs off the event loop: a multi-megabyte prompt used to freeze the server
    (no /health answer) for as long as the tokenizer took. (Tokenization is the server process's
    work whichever layout the engine has.)"""
    server = engine_thread_server
    import threading

    text = "hello world, " * 600_000  # ~7.8 MB, under the default body limit
    done = threading.Event()
    result = {}

    def tokenize():
        result["r"] = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=600)
        done.set()

    worker = threading.Thread(target=tokenize)
    worker.start()
    answers = 0
    while not done.is_set():
        response = httpx.get(server.url + "/health", timeout=30)
        assert response.status_code == 200
        if not done.is_set():
            answers += 1
        time.sleep(0.05)
    worker.join()
    assert result["r"].status_code == 200 and result["r"].json()["count"] > 600_000
    # blocked, the loop answers only while the body uploads (a handful); free, all along (~150 idle)
    assert answers >= 20, answers


def test_request_bodies_over_the_limit_are_413(tiny_qwen2_path):
    import asyncio

    from transformers import AutoTokenizer

    from refractor.inference.engine import EngineConfig, LLMEngine
    from refractor.inference.engine.async_engine import AsyncLLMEngine
    from refractor.inference.server import create_app

    engine = AsyncLLMEngine(
        LLMEngine.from_pretrained(tiny_qwen2_path, EngineConfig(max_model_len=128, kv_cache_memory_gb=0.01))
    )
    app = create_app(
        engine, AutoTokenizer.from_pretrained(tiny_qwen2_path), "t", max_request_body_bytes=2**20
    )
    big = json.dumps({"prompt": "x" * (2**20 + 10), "max_tokens": 1}).encode()

    async def chunks():  # no Content-Length: counted while it streams
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            declared = await client.post("/v1/completions", content=big)
            streamed = await client.post("/v1/completions", content=chunks())
            small = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        return declared, streamed, small

    try:
        declared, streamed, small = asyncio.run(main())
    finally:
        engine.shutdown()
    for response in (declared, streamed):
        assert response.status_code == 413, response.text
        assert "limit is 1048576 bytes" in response.json()["error"]["message"]
    assert small.status_code == 200


def test_streamed_completions_and_chat_equal_the_whole_answers(server):
    """SSE through the official client: the streamed pieces add up to the non-streamed answer (same
    seed), choices finish once with the same reason, stop strings never leak into the stream, the
    usage comes last when asked, and echo puts the prompt first."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    body = {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "max_tokens": 24,
        "n": 2,
        "temperature": 1.0,
        "seed": 7,
    }
    whole = client.completions.create(**body, extra_body={"ignore_eos": True})
    texts, reasons, usage = {}, {}, None
    for chunk in client.completions.create(
        **body, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                assert c.index not in reasons
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens == 48

    # a stop string taken from the free text: the stream stops before it and never shows it
    free = whole.choices[0].text
    stop = next(
        free[i : i + 2] for i in range(3, len(free) - 1) if free[i : i + 2].strip() == free[i : i + 2]
    )
    stopped = "".join(
        c.text
        for chunk in client.completions.create(
            **{**body, "n": 1}, stop=[stop], stream=True, extra_body={"ignore_eos": True}
        )
        for c in chunk.choices
    )
    assert stop not in stopped and free.startswith(stopped)

    echoed = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, echo=True, temperature=0)
    assert echoed.choices[0].text.startswith("Echo me")
    streamed_echo = "".join(
        c.text
        for chunk in client.completions.create(
            model=MODEL, prompt="Echo me", max_tokens=3, echo=True, temperature=0, stream=True
        )
        for c in chunk.choices
    )
    assert streamed_echo == echoed.choices[0].text

    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=3
    )
    pieces, roles, finish = [], [], []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=3, stream=True
    ):
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            pieces.append(c.delta.content or "")
            finish += [c.finish_reason] if c.finish_reason else []
    assert roles == ["assistant"] and "".join(pieces) == chat.choices[0].message.content
    assert finish == [chat.choices[0].finish_reason]


def test_a_stream_the_client_leaves_is_aborted(server):
    url = server.url
    body = {"prompt": [1, 2, 3], "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["object"] == "text_completion"
    deadline = time.monotonic() + 10
    while _metrics(url)["vllm:num_requests_running"] > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    metrics = _metrics(url)
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0
