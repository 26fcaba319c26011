"""The dashboard on a real run made by the README's quick start (3 steps on CPU): every API route
answers and every page shows that run's data in a real browser."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from refractor.ui import create_app
from refractor.ui.local import chromium_path, serve_in_thread

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "examples" / "quickstart.yaml"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_runs(quickstart_run, tmp_path_factory):
    """The shared quick-start run and a copy of it, in a runs folder of their own."""
    runs = tmp_path_factory.mktemp("quick") / "runs"
    for name in ("quick", "copy"):
        shutil.copytree(quickstart_run, runs / name, ignore=shutil.ignore_patterns(".lock"))
    return runs


def test_every_api_route_answers_on_a_quickstart_run(quick_runs, tmp_path):
    with TestClient(create_app([quick_runs], tmp_path)) as client:

        def ok(url, **params):
            resp = client.get(url, params=params)
            assert resp.status_code == 200, (url, resp.text)
            return resp.json()

        runs = {r["id"]: r for r in ok("/api/runs")["runs"]}
        assert runs["quick"]["status"] == "finished" and runs["quick"]["steps"] == 3
        run = ok("/api/runs/quick")
        assert (
            run["has"]["rollouts"] and run["has"]["events"] and run["has"]["code"] and run["has"]["topology"]
        )
        names = {n["name"] for n in ok("/api/runs/quick/metric-names")["names"]}
        assert {"reward_sum_mean", "loss", "grad_norm"} <= names
        assert ok("/api/runs/quick/metrics", names="reward_sum_mean")["series"]["reward_sum_mean"][
            "steps"
        ] == [0, 1, 2]
        derived = ok("/api/runs/quick/derived", envs="repeat_letter")["series"]
        assert derived["reward_sum_mean"]["steps"] == [0, 1, 2]
        assert "repeat_letter" in run["metric_ranges"]  # the run recorded its environments' records
        page = ok("/api/runs/quick/steps/1/rollouts")
        assert page["total"] == 4 * 16
        detail = ok(f"/api/runs/quick/rollouts/{page['rollouts'][0]['rollout_id']}")
        assert detail["turns"] and detail["prompt_text"]
        bounds = ok("/api/runs/quick/time-bounds")
        window = ok("/api/runs/quick/timeline", start=bounds["start"], end=bounds["end"])
        assert "forward" in window["events"]["name"] and window["lanes"]["rollouts"]["rollout_id"]
        metrics = ok("/api/runs/quick/system-names")["metrics"]
        assert any(m["source"] == "inference:server-0" for m in metrics)
        system = ok(
            "/api/runs/quick/system",
            name="system_memory_percent",
            start=bounds["system_start"],
            end=bounds["system_end"],
        )
        assert system["series"]
        assert ok("/api/runs/quick/topology")["topology"]["trainer"]["world_size"] == 1
        code = ok("/api/runs/quick/code")
        assert any(f["path"] == "configs/examples/quickstart.yaml" for f in code["files"])
        text = ok("/api/runs/quick/code/file", root="project", path="configs/examples/quickstart.yaml")[
            "text"
        ]
        assert text == QUICKSTART.read_text()
        assert ok("/api/code-diff", a="quick", b="copy")["same"]


@pytest.mark.skipif(chromium_path() is None, reason="no system Chromium (apt-get install chromium)")
def test_every_page_shows_the_quickstart_run(quick_runs, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    with serve_in_thread([quick_runs], tmp_path) as base, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(20_000)
        page.goto(f"{base}/#/metrics?runs=quick")
        page.locator("[data-testid='chart-reward_sum_mean'] .chart[data-drawn='1']").wait_for()
        page.goto(f"{base}/#/rollouts?runs=quick&step=2")
        page.locator("tr.sample").first.click()
        page.get_by_test_id("rollout-detail").locator(".turn.assistant").first.wait_for()
        page.goto(f"{base}/#/timeline?runs=quick")
        page.locator("[data-testid='gantt'][data-drawn='1']").wait_for()
        page.goto(f"{base}/#/infra?runs=quick")
        page.locator("[data-testid='sys-system_memory_percent'] .chart[data-drawn='1']").wait_for()
        page.goto(f"{base}/#/topology?runs=quick")
        page.get_by_test_id("servers").get_by_text("server-0").wait_for()
        page.goto(f"{base}/#/code?runs=quick&file=project/configs/examples/quickstart.yaml")
        page.get_by_test_id("code-text").get_by_text("repeat_letter").first.wait_for()
        page.goto(f"{base}/#/code?runs=quick,copy&against=copy")
        page.get_by_text("are the same").wait_for()
        page.goto(f"{base}/#/logs?runs=quick&component=trainer")
        page.get_by_test_id("logs-table").get_by_text("trainer rank 0/1 on cpu").wait_for()
        browser.close()
