"""Dropped connections under orchestrator-like load: the keep-alive race, before and after.

1,024 closed-loop lanes each send ``--requests`` generation requests to one ``refractor serve``
process (a tiny model on CPU), with an idle gap drawn from 0-``--max-gap`` seconds between a lane's
requests, as lanes idle while rewards are computed. Two configurations in one run:

* **before**: the server closes idle connections after 5 s (uvicorn's default, which refractor's
  server used) and the client is a plain ``httpx.AsyncClient`` that keeps idle connections 5 s and
  never resends (what the orchestrator's client did): a request sent on a connection as the server
  closes it fails.
* **after**: refractor's server keeps idle connections 65 s and ``InferenceClient`` lets go of them
  after 4 s, and sends a request once more when the server closed its connection under it.

Prints the transport errors of each (count and kinds) and the resends.

    PYTHONPATH=src python bench/bench_keepalive.py --lanes 1024 --requests 3 --max-gap 5
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import time
from pathlib import Path

import httpx

from refractor.inference.client import InferenceClient, InferenceServerError, Sampling
from refractor.inference.native_launcher import start_native_server
from refractor.inference.process import raise_open_file_limit
from refractor.testing import TinyModelSpec, build_tiny_model


async def lane_loop(
    send, lane: int, requests: int, gaps: tuple[float, float], errors: collections.Counter
) -> int:
    rng = random.Random(lane)
    answered = 0
    for _ in range(requests):
        await asyncio.sleep(rng.uniform(*gaps))
        try:
            await send([3 + lane % 50, 4, 5, 6], rng.randint(1, 8))
            answered += 1
        except (httpx.TransportError, InferenceServerError) as err:
            errors[type(err.__cause__ or err).__name__] += 1
    return answered


async def run(url: str, lanes: int, requests: int, gaps: tuple[float, float], refractor_client: bool) -> dict:
    errors: collections.Counter = collections.Counter()
    if refractor_client:
        client = InferenceClient(url, max_connections=2 * lanes)

        async def send(ids, max_tokens):
            await client.generate(ids, Sampling(max_tokens=max_tokens, ignore_eos=True))

        close = client.close
    else:
        http = httpx.AsyncClient(
            base_url=url, timeout=600, limits=httpx.Limits(max_connections=2 * lanes, keepalive_expiry=5.0)
        )

        async def send(ids, max_tokens):
            body = {"token_ids": ids, "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True}}
            (await http.post("/inference/v1/generate", json=body)).raise_for_status()

        close = http.aclose
    start = time.monotonic()
    answered = await asyncio.gather(*(lane_loop(send, i, requests, gaps, errors) for i in range(lanes)))
    seconds = time.monotonic() - start
    resends = client.closed_connection_retries if refractor_client else 0
    await close()
    return {
        "requests": lanes * requests,
        "answered": sum(answered),
        "transport_errors": sum(errors.values()),
        "errors_by_kind": dict(errors),
        "resends": resends,
        "seconds": seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lanes", type=int, default=1024)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--min-gap", type=float, default=0.0)
    p.add_argument("--max-gap", type=float, default=5.0)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    raise_open_file_limit()
    model = build_tiny_model(TinyModelSpec())
    results = {}
    for name, keep_alive, refractor_client in (("before", 5, False), ("after", None, True)):
        engine_args = {"max_model_len": 256, "kv_cache_memory_gb": 0.2, "max_num_seqs": 256}
        if keep_alive is not None:
            engine_args["timeout_keep_alive"] = keep_alive
        server = start_native_server(str(model), engine_args=engine_args)
        try:
            results[name] = asyncio.run(
                run(server.url, args.lanes, args.requests, (args.min_gap, args.max_gap), refractor_client)
            )
        finally:
            server.stop()
        r = results[name]
        print(
            f"{name}: {r['answered']}/{r['requests']} answered, {r['transport_errors']} transport errors "
            f"{r['errors_by_kind']}, {r['resends']} resends, {r['seconds']:.1f} s",
            flush=True,
        )
    Path(args.out, "bench_keepalive.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
