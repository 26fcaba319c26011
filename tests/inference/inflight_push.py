"""One streamed ``/inference/v1/generate`` request with a weight push that lands while it decodes: the
in-flight case of the vLLM update tests (full weights and LoRA adapters). Imported by the tests of this
folder as ``inflight_push``."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
from sse_events import data_events

# the push starts once this many tokens have streamed, so it cannot land before the request decodes
TOKENS_BEFORE_PUSH = 10
PUSH_TIMEOUT_S = 120


@dataclass
class StreamedRequest:
    tokens: list[int]
    logprobs: list[float]
    # the server's spans, as sent: {"version": str, "start": int, "end": int} over the output tokens
    weight_versions: list[dict[str, Any]]

    @property
    def switched_versions(self) -> bool:
        """False when the request ended before the push landed (the tiny model can outrun it on busy
        cores): the in-flight case was not provoked."""
        return len(self.weight_versions) > 1


def stream_while_pushing(
    url: str, model: str, prompt: list[int], push: Callable[[], object], *, max_tokens: int, seed: int
) -> StreamedRequest:
    """Streams ``max_tokens`` tokens sampled at temperature 1 (EOS ignored, each with its log-prob) and
    calls ``push`` from a thread once ``TOKENS_BEFORE_PUSH`` of them arrived. Returns when both are done;
    an error of the push is raised here, so it cannot pass for a push that landed too late."""
    body = {
        "model": model,
        "token_ids": prompt,
        "stream": True,
        "sampling_params": {
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "logprobs": 0,
            "ignore_eos": True,
            "seed": seed,
        },
    }
    tokens: list[int] = []
    logprobs: list[float] = []
    spans: list[dict[str, Any]] = []
    finish = None
    pushed = None
    with ThreadPoolExecutor(max_workers=1) as pool:
        with httpx.stream("POST", url + "/inference/v1/generate", json=body, timeout=300) as response:
            for event in data_events(response):
                (choice,) = event["choices"]
                tokens += choice["token_ids"]
                logprobs += [entry["logprob"] for entry in choice["logprobs"]["content"]]
                spans = choice["weight_versions"] or spans
                finish = choice["finish_reason"]
                if pushed is None and len(tokens) >= TOKENS_BEFORE_PUSH:
                    pushed = pool.submit(push)
        assert pushed is not None, f"the request ended after {len(tokens)} tokens, before the push started"
        pushed.result(timeout=PUSH_TIMEOUT_S)
    assert finish == "length" and len(tokens) == max_tokens and spans, (finish, len(tokens), spans)
    return StreamedRequest(tokens, logprobs, spans)
