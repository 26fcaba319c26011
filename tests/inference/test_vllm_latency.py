"""A real vLLM CPU server exports each request's trace span to the OTLP receiver, which hands the
request's latency to whoever knows the id the client sent (docs/metrics.md#latency)."""

from __future__ import annotations

import asyncio

import pytest

from refractor.inference.client import InferenceClient, Sampling
from refractor.telemetry.otlp import LATENCY_ATTRIBUTES


@pytest.mark.vllm
def test_a_generate_request_gets_its_latency_from_vllms_trace_span(
    vllm_server, vllm_model_name, otlp_receiver
):
    async def main():
        async with InferenceClient(vllm_server.url, model=vllm_model_name) as client:
            result = await client.generate(
                list(range(3, 20)), Sampling(max_tokens=8, ignore_eos=True), request_id="latency-check"
            )
            # generous for a loaded CI machine; the span itself comes within ~200 ms
            return result, await otlp_receiver.take(result.server_request_id, 30.0)

    result, latency = asyncio.run(main())
    assert result.latency == {} and len(result.token_ids) == 8  # vLLM's answer carries no latency
    assert result.server_request_id == "generate-tokens-latency-check"
    assert latency is not None and set(latency) == set(LATENCY_ATTRIBUTES.values())
    assert all(v >= 0 for v in latency.values())
    assert latency["e2e_latency"] >= latency["ttft"] >= latency["prefill_time"]
    assert latency["inference_time"] >= latency["decode_time"] > 0  # 8 tokens were decoded
