"""Where generation throughput goes between the engine and the orchestrator's requests.

The same closed-loop workload runs three ways, in one process run, on one model:

- ``engine``: ``LLMEngine.step()`` called in a plain loop (the ``bench_engine.py`` path);
- ``async``: ``AsyncLLMEngine`` (the engine thread the server uses) with ``c`` asyncio clients in
  the same process, no HTTP;
- ``http``: the real server subprocess (``refractor serve --engine native``) and ``c`` clients
  going through ``InferenceClient.generate`` (``/inference/v1/generate``), the orchestrator's path.

Closed loop: ``c`` requests are always in flight; when one finishes the next starts, as lanes do in
a run. A request is one sample (the orchestrator sends samples, not groups): ``--prompt-len`` random
prompt tokens, ``max_tokens`` drawn from [(1 - jitter) * gen_len, gen_len] so finishes are staggered
the way a run's are, EOS ignored. Reported per mode: completion tokens/s over the measured window
(requests started after ``--warmup`` finished ones), requests/s, and the ratio to ``engine``.

    PYTHONPATH=src python bench/bench_serving.py --model tiny --concurrency 32 --requests 256
    PYTHONPATH=src python bench/bench_serving.py --model 0.5b --concurrency 64,256 --gen-len 512   # GPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from refractor.testing import TEST_CONTROL_TOKEN


def model_path(name: str, workdir: Path) -> Path:
    if name == "tiny":
        from refractor.testing import tiny_qwen2

        return tiny_qwen2()
    if name in ("0.5b", "1.5b"):
        from bench_rl import build_model

        return build_model(workdir / f"qwen25-{name}", name)
    return Path(name)


def workload(n: int, prompt_len: int, gen_len: int, jitter: float, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    low = max(1, int(round(gen_len * (1 - jitter))))
    return [
        ([rng.randrange(3, vocab) for _ in range(prompt_len)], rng.randint(low, gen_len)) for _ in range(n)
    ]


def summarize(mode: str, finished: list[tuple[float, float, int]], warmup: int) -> dict:
    """finished: (start, end, tokens) per request in finish order.

    The window is the steady state: from the warm-up's last finish to the moment the last request
    started (from then on lanes run dry and fewer than ``c`` requests are in flight). A request's
    tokens count in proportion to the part of its life inside the window (tokens come at a steady
    rate once it runs).
    """
    window_start = finished[warmup - 1][1] if warmup else min(s for s, _, _ in finished)
    window_end = max(s for s, _, _ in finished)
    if window_end <= window_start:
        raise SystemExit(f"{mode}: no steady state; send more requests than --warmup + concurrency")
    seconds = window_end - window_start
    tokens = sum(
        t * max(0.0, min(e, window_end) - max(s, window_start)) / (e - s) for s, e, t in finished if e > s
    )
    requests = sum(1 for _, e, _ in finished if window_start < e <= window_end)
    return {
        "mode": mode,
        "tok_s": tokens / seconds,
        "req_s": requests / seconds,
        "seconds": seconds,
        "requests": requests,
    }


def release_memory() -> None:
    """Free the in-process engine's KV cache before the next mode (the server subprocess needs the GPU)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_engine(
    path: Path, jobs, concurrency: int, warmup: int, engine_args: dict, logprobs: int | None = 0
) -> dict:
    """``logprobs``: what each request asks for; 0 (the default) is what the orchestrator's client
    asks (the sampled token's log-prob and rank), so the loop does the same work as the server."""
    from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(path, EngineConfig(**engine_args))
    pending = list(enumerate(jobs))
    started = {}
    finished = []

    def submit() -> None:
        i, (ids, max_tokens) = pending.pop(0)
        engine.add_request(
            f"r{i}",
            ids,
            SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs),
        )
        started[f"r{i}"] = time.perf_counter()

    for _ in range(min(concurrency, len(pending))):
        submit()
    while engine.has_unfinished():
        for out in engine.step():
            finished.append((started[out.request_id], time.perf_counter(), out.num_generated_tokens))
            if pending:
                submit()
    return summarize("engine", finished, warmup)


async def _closed_loop(generate, jobs, concurrency: int) -> list[tuple[float, float, int]]:
    queue = list(enumerate(jobs))
    finished: list[tuple[float, float, int]] = []

    async def lane() -> None:
        while queue:
            i, (ids, max_tokens) = queue.pop(0)
            start = time.perf_counter()
            tokens = await generate(i, ids, max_tokens)
            finished.append((start, time.perf_counter(), tokens))

    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return finished


def run_async(path: Path, jobs, concurrency: int, warmup: int, engine_args: dict) -> dict:
    from refractor.inference.engine import EngineConfig, LLMEngine, SamplingParams
    from refractor.inference.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(LLMEngine.from_pretrained(path, EngineConfig(**engine_args)))

    async def generate(i, ids, max_tokens):
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        return (await engine.generate(ids, params, f"r{i}")).num_generated_tokens

    try:
        finished = asyncio.run(_closed_loop(generate, jobs, concurrency))
    finally:
        engine.shutdown()
    return summarize("async", finished, warmup)


def run_http(path: Path, jobs, concurrency: int, warmup: int, engine_args: dict, log_path: Path) -> dict:
    from refractor.inference.client import InferenceClient, Sampling
    from refractor.inference.native_launcher import start_native_server

    env = {"OMP_NUM_THREADS": str(torch.get_num_threads())}  # the same intra-op threads as the other modes
    server = start_native_server(
        str(path), control_token=TEST_CONTROL_TOKEN, engine_args=engine_args, log_path=str(log_path), env=env
    )

    async def main():
        async with InferenceClient(server.url, control_token=TEST_CONTROL_TOKEN) as client:

            async def generate(i, ids, max_tokens):
                result = await client.generate(ids, Sampling(max_tokens=max_tokens, ignore_eos=True))
                return len(result.token_ids)

            return await _closed_loop(generate, jobs, concurrency), client.closed_connection_retries

    probe = ServerProbe(server)
    try:
        finished, resends = asyncio.run(main())
    finally:
        usage = probe.stop()
        server.stop()
    # requests sent again after the server closed their connection under them (0: no keep-alive race)
    out = summarize("http", finished, warmup) | {"resends": resends, "usage": usage}
    if "engine_latency_s" in usage:  # the client's latency over the same requests (those of the probe)
        usage["client_latency_s"] = statistics.mean(e - s for s, e, _ in finished[warmup:])
    return out


class ServerProbe:
    """Where the time goes in the HTTP mode: CPU seconds per wall second of this process (the
    client), the server process and its engine process (when it has one), and the server's own
    account from ``/metrics`` (sampled every 0.5 s): sequences running and waiting, the engine's
    busy fraction and mean step time."""

    def __init__(self, server) -> None:
        import psutil

        self.url = server.url
        root = psutil.Process(server.process.pid)
        self.procs = {"client": psutil.Process(), "server": root}
        for i, child in enumerate(root.children(recursive=True)):
            self.procs[f"server_child{i}"] = child
        self.cpu0 = {name: self._cpu(p) for name, p in self.procs.items()}
        self.t0 = time.perf_counter()
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @staticmethod
    def _cpu(proc) -> float:
        try:
            t = proc.cpu_times()
            return t.user + t.system
        except Exception:  # noqa: BLE001 - a process that is gone has no more time to count
            return float("nan")

    def _loop(self) -> None:
        import httpx

        from refractor.inference.client import summed_samples

        with httpx.Client(timeout=5) as http:
            while not self._stop.wait(0.5):
                with contextlib.suppress(httpx.HTTPError):
                    self.samples.append(summed_samples(http.get(self.url + "/metrics").text))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        wall = time.perf_counter() - self.t0
        out = {f"cpu_{name}": (self._cpu(p) - self.cpu0[name]) / wall for name, p in self.procs.items()}
        busy = [x for x in self.samples if x.get("vllm:num_requests_running", 0) > 0]
        if len(busy) >= 2:
            first, last = busy[0], busy[-1]
            steps = last["refractor:engine_steps_total"] - first["refractor:engine_steps_total"]
            seconds = (
                last["refractor:engine_busy_seconds_total"] - first["refractor:engine_busy_seconds_total"]
            )
            out["running"] = sum(x["vllm:num_requests_running"] for x in busy) / len(busy)
            out["waiting"] = sum(x["vllm:num_requests_waiting"] for x in busy) / len(busy)
            out["engine_busy"] = seconds / ((len(busy) - 1) * 0.5)
            out["step_ms"] = 1e3 * seconds / max(steps, 1)
            # the engine's own request latency (arrival in the engine -> finished), to set against
            # the client's: the difference is the time a request spends outside the engine
            count = "vllm:e2e_request_latency_seconds_count"
            done = last.get(count, 0) - first.get(count, 0)
            if done:
                total = "vllm:e2e_request_latency_seconds_sum"
                out["engine_latency_s"] = (last[total] - first.get(total, 0.0)) / done
        return out


def parse_mode(mode: str) -> tuple[str, dict]:
    """``engine+decode_steps_between_prefills=0+enable_prefix_caching=false``: a mode and the
    EngineConfig fields it overrides (JSON values)."""
    kind, *pairs = mode.split("+")
    overrides = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        overrides[key] = json.loads(value)
    return kind, overrides


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny", help="tiny | 0.5b | 1.5b | a local HF model path")
    parser.add_argument("--concurrency", default="32")
    parser.add_argument("--requests", type=int, default=256, help="requests per concurrency level and mode")
    parser.add_argument(
        "--warmup", type=int, default=None, help="finished requests before the window (default c)"
    )
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--jitter", type=float, default=0.5)
    parser.add_argument(
        "--modes",
        default="engine,async,http",
        help="comma-separated engine | async | http, each optionally +field=value (EngineConfig overrides)",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-gb", type=float, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU runs)")
    parser.add_argument(
        "--engine-logprobs",
        type=lambda v: None if v == "none" else int(v),
        default=0,
        help="what the engine loop's requests ask for: 0 (default, as the orchestrator's client: the "
        "sampled token's log-prob and rank) or none",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    workdir = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    path = model_path(args.model, workdir)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    max_model_len = args.max_model_len or args.prompt_len + args.gen_len + 64
    results = {"device": device, "torch": torch.__version__, "args": vars(args), "runs": []}
    print(
        f"device {device}, model {args.model}, prompt {args.prompt_len}, gen {args.gen_len} "
        f"(jitter {args.jitter}), {args.requests} requests per run",
        flush=True,
    )
    for c in (int(x) for x in args.concurrency.split(",")):
        engine_args = {"max_model_len": max_model_len, "max_num_seqs": max(c, 1)}
        if args.kv_cache_gb:
            engine_args["kv_cache_memory_gb"] = args.kv_cache_gb
        elif not cuda:
            engine_args["kv_cache_memory_gb"] = 0.5
        else:  # one engine at a time, but leave room for the previous mode's leftovers
            engine_args["gpu_memory_utilization"] = 0.6
        jobs = workload(args.requests, args.prompt_len, args.gen_len, args.jitter, vocab)
        warmup = args.warmup if args.warmup is not None else min(c, args.requests // 4)
        rows = []
        for mode in args.modes.split(","):
            kind, overrides = parse_mode(mode)
            run_args = {**engine_args, **overrides}
            if kind == "engine":
                row = run_engine(path, jobs, c, warmup, run_args, args.engine_logprobs)
            elif kind == "async":
                row = run_async(path, jobs, c, warmup, run_args)
            elif kind == "http":
                row = run_http(path, jobs, c, warmup, run_args, workdir / f"server-c{c}.log")
            else:
                raise SystemExit(f"unknown mode {kind!r}: choose from engine, async, http")
            row["mode"] = mode
            release_memory()  # the in-process engine is gone with its function: free its KV cache now
            row["concurrency"] = c
            rows.append(row)
            base = rows[0]["tok_s"]
            print(
                f"c={c:4d} {mode:7s} {row['tok_s']:9.0f} tok/s {row['req_s']:7.1f} req/s "
                f"({row['requests']} requests in {row['seconds']:.2f} s)  x{row['tok_s'] / base:.2f} vs "
                f"{rows[0]['mode']}" + (f", {row['resends']} resends" if "resends" in row else ""),
                flush=True,
            )
            if "usage" in row:
                print("         " + ", ".join(f"{k} {v:.2f}" for k, v in row["usage"].items()), flush=True)
        results["runs"] += rows
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_serving.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
