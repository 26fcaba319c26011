"""Dashboard speed on a day-long synthetic run (issue sizes): every API route's p95 and the
metrics and rollouts pages' render time in headless Chromium, and the server's memory.

    python bench/dashboard.py                 # generates the run once under /tmp (minutes), then measures
    python bench/dashboard.py --small         # a quick run of the same measurements on a small store

The run store is cached in --cache (a spec change regenerates it). The server runs as its own
process (`refractor ui`), so its memory is measured alone; each route is called --repeat times
and the first call (cold: nothing cached by the server) is reported apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from refractor.telemetry.store import connect_writer
from refractor.telemetry.synthetic import SyntheticSpec, write_synthetic_run
from refractor.ui.local import chromium_path, free_port

ISSUE_SPEC = SyntheticSpec(
    steps=2000,
    rollouts_per_step=125,
    group_size=5,
    step_metrics=300,
    trainer_ranks=8,
    microbatches=39,  # 8 ranks x 120 spans + ~53 orchestrator events a step: ~2M events
    step_seconds=43.2,  # 2000 steps = 24 h, so 24 h of 1 s metrics of 8 GPUs
    gpus=8,
    servers=4,
)
SMALL_SPEC = dataclasses.replace(ISSUE_SPEC, steps=50, step_seconds=10.0)


def ensure_run(cache: Path, spec: SyntheticSpec) -> Path:
    run_dir = cache / "big"
    stamp = cache / "spec.json"
    wanted = json.dumps(dataclasses.asdict(spec), sort_keys=True)
    if (run_dir / "run.db").is_file() and stamp.is_file() and stamp.read_text() == wanted:
        connect_writer(run_dir / "run.db").close()  # a store cached by an older schema gets its indexes
        return run_dir
    print(f"generating the synthetic run in {run_dir} (once; minutes at issue size)...", flush=True)
    began = time.perf_counter()
    write_synthetic_run(run_dir, spec)
    stamp.write_text(wanted)
    size = (run_dir / "run.db").stat().st_size / 2**20
    print(f"  generated in {time.perf_counter() - began:.0f} s, run.db {size:.0f} MiB", flush=True)
    return run_dir


def routes(spec: SyntheticSpec, bounds: dict) -> list[str]:
    mid = spec.steps // 2
    names = "reward_sum_mean,loss,entropy,grad_norm,kl_divergence_inference,length_completion_mean"
    t0 = bounds["start"]
    t1 = bounds["end"]
    w0 = t0 + mid * spec.step_seconds
    w1 = w0 + 3 * spec.step_seconds
    s0 = bounds["system_start"]
    s1 = bounds["system_end"]
    return [
        "/api/runs",
        "/api/runs/big",
        "/api/runs/big/cursor",
        "/api/runs/big/metric-names",
        f"/api/runs/big/metrics?names={names}",
        f"/api/runs/big/metrics?names={names},trainer/extra/metric_000,trainer/extra/metric_001,"
        "advantage_std,stop_reason_length_pct,reward_gini_mean,group_length_gini_mean",
        "/api/runs/big/derived",
        "/api/runs/big/derived?envs=math",
        f"/api/runs/big/histogram?field=reward&step={mid}",
        "/api/runs/big/distribution?field=completion_tokens",
        "/api/runs/big/steps",
        f"/api/runs/big/steps/{mid}/rollouts",
        f"/api/runs/big/steps/{mid}/rollouts?env=code_tools&sort=reward&desc=true",
        f"/api/runs/big/steps/{mid}/rollouts?q=Answer",
        f"/api/runs/big/steps/{mid}/rollouts?status=discarded,cancelled",
        f"/api/runs/big/rollouts/{mid * spec.rollouts_per_step}",
        "/api/runs/big/evals",
        "/api/runs/big/time-bounds",
        # as the timeline page asks: at most 8000 events, none under ~a pixel (1/1500 of the window)
        f"/api/runs/big/timeline?start={w0}&end={w1}&limit=8000&min_duration={(w1 - w0) / 1500}",
        f"/api/runs/big/timeline?start={w0}&end={w0 + 3600}&limit=8000&min_duration={3600 / 1500}",
        f"/api/runs/big/timeline?start={t0}&end={t1}&limit=8000&min_duration={(t1 - t0) / 1500}",
        "/api/runs/big/system-names",
        f"/api/runs/big/system?name=gpu_utilization_percent&start={s0}&end={s1}&points=600",
        f"/api/runs/big/system?name=gpu_utilization_percent&start={s0}&end={s0 + 300}",
        "/api/runs/big/topology",
        "/api/config-diff?a=big&b=big",
        "/api/search?q=learning_rate=1e-6,loss_type=grpo",
    ]


def measure_api(client: httpx.Client, urls: list[str], repeat: int) -> list[tuple[str, float, float, float]]:
    out = []
    for url in urls:
        times = []
        for _ in range(repeat):
            began = time.perf_counter()
            resp = client.get(url)
            times.append(1000 * (time.perf_counter() - began))
            if resp.status_code != 200:
                raise SystemExit(f"{url}: HTTP {resp.status_code} {resp.text[:200]}")
        warm = sorted(times[1:]) or times
        p95 = warm[min(len(warm) - 1, int(round(0.95 * (len(warm) - 1))))]
        out.append((url, times[0], statistics.median(warm), p95))
    return out


def measure_pages(base: str, spec: SyntheticSpec, repeat: int) -> list[tuple[str, list[float]]]:
    from playwright.sync_api import sync_playwright

    mid = spec.steps // 2
    pages = [
        (
            "metrics: 12 charts x 2000 steps",
            "#/metrics?runs=big",
            "[data-testid^='chart-'] .chart[data-drawn='1']",
            12,
        ),
        ("rollouts of one step", f"#/rollouts?runs=big&step={mid}", "tr.sample", 1),  # one render draws all
        ("timeline: last 3 steps", "#/timeline?runs=big", "[data-testid='gantt'][data-drawn='1']", 1),
    ]
    out = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        for label, route, selector, count in pages:
            times = []
            for _ in range(repeat):
                context = browser.new_context(viewport={"width": 1400, "height": 900})
                page = context.new_page()
                began = time.perf_counter()
                page.goto(f"{base}/{route}")
                page.locator(selector).nth(count - 1).wait_for(timeout=60_000)
                times.append(1000 * (time.perf_counter() - began))
                context.close()
            out.append((label, times))
        browser.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="a small store (seconds), same measurements")
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "refractor-dashboard-bench"
    )
    parser.add_argument("--repeat", type=int, default=20, help="calls per API route")
    parser.add_argument("--page-repeat", type=int, default=5, help="loads per page")
    args = parser.parse_args()
    spec = SMALL_SPEC if args.small else ISSUE_SPEC
    cache = args.cache / ("small" if args.small else "issue")
    cache.mkdir(parents=True, exist_ok=True)
    run_dir = ensure_run(cache, spec)
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "refractor.cli",
            "ui",
            "--runs-dir",
            str(run_dir.parent),
            "--port",
            str(port),
            "--no-open",
            "--state-dir",
            str(cache / "state"),
        ],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=120) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    client.get("/api/version")
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise SystemExit("the dashboard server did not start") from None
                    time.sleep(0.2)
            bounds = client.get("/api/runs/big/time-bounds").json()
            api = measure_api(client, routes(spec, bounds), args.repeat)
        pages = measure_pages(base, spec, args.page_repeat)
        rss = psutil.Process(server.pid).memory_info().rss / 2**20
    finally:
        server.terminate()
        server.wait(10)
    print(
        f"\nrun: {spec.steps} steps x {spec.rollouts_per_step} rollouts, {spec.step_metrics} step metrics, "
        f"{spec.trainer_ranks} ranks; {os.cpu_count()} CPU(s)"
    )
    print(f"\n{'API route':<110} {'cold ms':>8} {'median':>8} {'p95 ms':>8}")
    for url, cold, median, p95 in api:
        flag = "" if p95 <= 200 else "  > 200 ms"
        print(f"{url[:110]:<110} {cold:8.1f} {median:8.1f} {p95:8.1f}{flag}")
    print(f"\nworst p95: {max(p for *_, p in api):.1f} ms (target <= 200 ms)")
    print(f"\n{'page (navigation to drawn)':<40} {'median ms':>10} {'max ms':>8}")
    for label, times in pages:
        print(f"{label:<40} {statistics.median(times):10.0f} {max(times):8.0f}")
    print(f"\nserver memory (RSS) after the run: {rss:.0f} MiB (target <= 500 MB)")


if __name__ == "__main__":
    main()
