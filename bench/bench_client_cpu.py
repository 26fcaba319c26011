"""The orchestrator's CPU per generation request: refractor's ``InferenceClient`` against plain
``httpx`` and ``aiohttp``, on one ``refractor serve`` process (a tiny model on CPU).

The driver sends one ``/inference/v1/generate`` request per sample from one asyncio event loop, so
the client's CPU per request bounds how many samples per second a run can take in, whatever the
GPUs do: 512 samples per step at 2 ms each is a second of the event loop per step. Each client
sends ``--requests`` requests with ``--lanes`` in flight (closed loop), after one warm-up round,
and the client process's own CPU time (``time.process_time``, which the server's work beside it
does not enter) is divided by the requests. Same request body for all three (a 50-token prompt,
``--max-tokens`` tokens); each keeps a connection per lane.

    PYTHONPATH=src python bench/bench_client_cpu.py --lanes 256,1024 --requests 2048
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx
import orjson

from refractor.inference.client import InferenceClient, Sampling, connections_for_lanes
from refractor.inference.native_launcher import start_native_server
from refractor.inference.process import raise_open_file_limit
from refractor.testing import TinyModelSpec, build_tiny_model

PROMPT = list(range(10, 60))
ROUTE = "/inference/v1/generate"


async def cpu_per_request(send: Callable[[], Awaitable[None]], lanes: int, requests: int) -> dict:
    await asyncio.gather(*(send() for _ in range(lanes)))  # warm-up: every lane's connection opened
    gate = asyncio.Semaphore(lanes)

    async def one() -> None:
        async with gate:
            await send()

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(requests)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"cpu_ms_per_request": 1e3 * cpu / requests, "requests_per_s": requests / wall}


async def refractor_client(url: str, lanes: int, requests: int, max_tokens: int) -> dict:
    async with InferenceClient(url, max_connections=connections_for_lanes(lanes)) as client:
        sampling = Sampling(max_tokens=max_tokens, ignore_eos=True)

        async def send() -> None:
            await client.generate(PROMPT, sampling)

        return await cpu_per_request(send, lanes, requests)


def body(max_tokens: int) -> bytes:
    return orjson.dumps(
        {"token_ids": PROMPT, "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True}}
    )


async def httpx_client(url: str, lanes: int, requests: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=connections_for_lanes(lanes))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        content, headers = body(max_tokens), {"content-type": "application/json"}

        async def send() -> None:
            response = await http.post(ROUTE, content=content, headers=headers)
            response.raise_for_status()
            orjson.loads(response.content)

        return await cpu_per_request(send, lanes, requests)


async def aiohttp_client(url: str, lanes: int, requests: int, max_tokens: int) -> dict:
    connector = aiohttp.TCPConnector(limit=connections_for_lanes(lanes))
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:
        content, headers = body(max_tokens), {"content-type": "application/json"}

        async def send() -> None:
            async with session.post(ROUTE, data=content, headers=headers) as response:
                response.raise_for_status()
                orjson.loads(await response.read())

        return await cpu_per_request(send, lanes, requests)


CLIENTS = {"refractor": refractor_client, "httpx": httpx_client, "aiohttp": aiohttp_client}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lanes", default="256,1024", help="comma list: requests in flight")
    p.add_argument("--requests", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    raise_open_file_limit()
    lane_counts = [int(n) for n in args.lanes.split(",")]
    model = build_tiny_model(TinyModelSpec())
    engine_args = {"max_model_len": 256, "kv_cache_memory_gb": 0.5, "max_num_seqs": max(lane_counts)}
    server = start_native_server(str(model), engine_args=engine_args)
    results = []
    try:
        for lanes in lane_counts:
            for name in args.clients.split(","):
                r = asyncio.run(CLIENTS[name](server.url, lanes, args.requests, args.max_tokens))
                results.append({"client": name, "lanes": lanes, **r})
                print(
                    f"{name:>9}, {lanes} lanes: {r['cpu_ms_per_request']:.2f} ms of client CPU per request "
                    f"({r['requests_per_s']:.0f} requests/s)",
                    flush=True,
                )
    finally:
        server.stop()
    for lanes in lane_counts:
        by = {r["client"]: r["cpu_ms_per_request"] for r in results if r["lanes"] == lanes}
        if "refractor" in by:
            ratios = ", ".join(
                f"{name} {by['refractor'] / ms:.1f}x" for name, ms in by.items() if name != "refractor"
            )
            print(f"{lanes} lanes: refractor's client CPU per request / other: {ratios}")
    Path(args.out, "bench_client_cpu.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
