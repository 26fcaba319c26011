"""Every dashboard page in a real browser (headless system Chromium driven by Playwright) against
a real server on synthetic run stores: charts drawn, tables filled, filters work, a rollout with
tool calls renders its conversation, the custom layout survives a restart, the timeline zooms,
live updates appear while a run writes, bad runs show their reason. Screenshots are kept under
pytest's temporary folder (``REFRACTOR_DOCS_SCREENSHOT=1`` also refreshes docs/dashboard.png)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from refractor.records import Rollout, RolloutStatus
from refractor.records.rollout import Turn
from refractor.records.training import TimelineEvent
from refractor.runtime.run_lock import RunLock
from refractor.telemetry.log_capture import LogLine
from refractor.telemetry.store import RunStore
from refractor.ui.local import chromium_path
from refractor.ui.local import serve_in_thread as serve

playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is part of the dev extra")
if chromium_path() is None:
    pytest.skip("no system Chromium (apt-get install chromium)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ui-state")


@pytest.fixture(scope="module")
def live_runs(tmp_path_factory):
    """A runs dir holding one run that the test writes to through the real RunStore."""
    return tmp_path_factory.mktemp("live-runs")


@pytest.fixture(scope="module")
def base(runs_dir, live_runs, state_dir):
    with serve([runs_dir, live_runs], state_dir) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser, base, tmp_path_factory):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = context.new_page()
    errors = []
    pg.on("pageerror", lambda err: errors.append(str(err)))
    pg.set_default_timeout(20_000)
    pg.base = base
    yield pg
    context.close()
    assert not errors, errors  # no uncaught script error on any page


def shot(page, name: str, tmp_path_factory) -> None:
    folder = tmp_path_factory.getbasetemp() / "screenshots"
    folder.mkdir(exist_ok=True)
    page.screenshot(path=str(folder / f"{name}.png"))


def save_small_png(png: bytes, path: Path) -> None:
    """The README's screenshot, reduced to a 64-colour palette when Pillow is there (~4x smaller)."""
    try:
        import io

        from PIL import Image
    except ImportError:
        path.write_bytes(png)
        return
    Image.open(io.BytesIO(png)).convert("RGB").quantize(64).save(path, optimize=True)


def go(page, route: str) -> None:
    page.goto(f"{page.base}/#/{route}")


def test_runs_page_lists_runs_compares_and_diffs_configs(page, tmp_path_factory):
    go(page, "runs")
    table = page.get_by_test_id("runs-table")
    table.locator("tr[data-run='syn']").wait_for()
    assert "finished" in table.locator("tr[data-run='syn']").inner_text()
    assert "crashed" in table.locator("tr[data-run='other']").inner_text()
    assert "cannot be read" in table.locator("tr[data-run='broken']").inner_text()
    page.get_by_label("compare syn").check()
    page.get_by_label("compare old").check()
    page.get_by_test_id("diff-configs").click()
    diff = page.get_by_test_id("config-diff")
    diff.wait_for()
    assert "learning_rate" in diff.inner_text() and "0.001" in diff.inner_text()
    assert "runs=syn%2Cold" in page.url or "runs=syn,old" in page.url  # bookmarkable
    page.get_by_test_id("config-search").fill("learning_rate=0.001")
    page.get_by_test_id("config-search").press("Enter")
    page.get_by_text("1 run(s) match").wait_for()
    assert table.locator("tr[data-run]").count() == 1
    shot(page, "runs", tmp_path_factory)


def test_metrics_page_draws_the_overview_for_two_runs_with_every_option(page, tmp_path_factory):
    go(page, "metrics?runs=syn,other")
    charts = page.locator("[data-testid^='chart-'] .chart[data-drawn='1']")
    charts.nth(11).wait_for()
    assert charts.count() == 12
    assert page.locator("[data-testid='chart-reward_sum_mean'] .chart").get_attribute("data-points") == "20"
    if os.environ.get("REFRACTOR_DOCS_SCREENSHOT"):
        save_small_png(page.screenshot(), ROOT / "docs" / "dashboard.png")
    shot(page, "metrics", tmp_path_factory)
    go(page, "metrics?runs=syn&smooth=0.8&log=1&skip=1&outliers=1")
    page.locator(
        "[data-testid='chart-loss'] .chart[data-drawn='1'][data-points='19']"
    ).wait_for()  # first left out
    page.get_by_test_id("env-filter").select_option("math")
    page.wait_for_url("**env=math**")
    page.locator("[data-testid='chart-reward_sum_mean'] .chart[data-drawn='1']").wait_for()
    page.get_by_test_id("normalise").check()
    page.wait_for_url("**norm=1**")
    page.locator("[data-testid='chart-reward_sum_mean'] .chart[data-drawn='1']").wait_for()
    page.get_by_test_id("metric-filter").fill("extra/metric_00")
    page.locator("[data-testid='chart-trainer/extra/metric_001'] .chart[data-drawn='1']").wait_for()
    page.locator("canvas.hist[data-drawn='1']").nth(1).wait_for()  # histogram and heatmap


def test_rollouts_page_filters_and_renders_a_tool_call_conversation(page, tmp_path_factory):
    go(page, "rollouts?runs=syn&step=5")
    rows = page.locator("[data-testid='rollouts-table'] tr.sample")
    rows.first.wait_for()
    everything = rows.count()
    page.get_by_test_id("rollout-env").select_option("code_tools")
    page.wait_for_function(f"document.querySelectorAll('tr.sample').length < {everything}")
    assert set(page.locator("tr.sample td:nth-child(2)").all_inner_texts()) == {"code_tools"}
    rows.first.click()
    detail = page.get_by_test_id("rollout-detail")
    detail.get_by_test_id("tool-call").first.wait_for()
    assert "python" in detail.get_by_test_id("tool-call").first.inner_text()
    assert detail.locator("details.think").count() >= 1  # <think> folded
    assert detail.locator(".katex").count() >= 1  # LaTeX rendered
    assert detail.locator(".turn.env").count() == 2  # the environment's answers
    shot(page, "rollout", tmp_path_factory)
    page.get_by_test_id("raw-toggle").check()
    detail.locator("pre.raw").first.wait_for()
    assert "<think>" in detail.inner_text()
    page.get_by_test_id("rollout-search").fill("no such text anywhere")
    page.get_by_test_id("rollout-search").press("Enter")
    page.get_by_text("No rollouts match").wait_for()


def test_discarded_tab_shows_reasons(page, runs_dir):
    from refractor.telemetry.query import RunReader

    with RunReader(runs_dir / "syn") as reader:
        step = reader.rollouts(status="discarded")[0]["step"]
    go(page, f"rollouts?runs=syn&tab=dropped&step={step}")
    page.locator("tr.sample").first.wait_for()
    text = page.get_by_test_id("rollouts-table").inner_text()
    assert "discarded" in text and ("zero_advantage" in text or "max_async" in text)


def test_timeline_draws_and_zooms(page, tmp_path_factory):
    go(page, "timeline?runs=syn")
    page.locator("[data-testid='gantt'][data-drawn='1']").wait_for()
    before = page.get_by_test_id("window").inner_text()
    page.get_by_test_id("zoom-in").click()
    page.wait_for_url("**start=**")
    page.wait_for_function(f"document.querySelector('[data-testid=window]').innerText !== {before!r}")
    page.locator("[data-testid='gantt'][data-drawn='1']").wait_for()
    box = page.get_by_test_id("gantt").bounding_box()
    page.mouse.click(box["x"] + box["width"] * 0.5, box["y"] + 22 + 18 * 2 + 9)  # trainer rank 0
    page.get_by_test_id("timeline-details").wait_for()
    shot(page, "timeline", tmp_path_factory)


def test_infra_topology_evals_code_and_logs_pages(page, tmp_path_factory):
    go(page, "infra?runs=syn")
    page.locator("[data-testid='sys-gpu_utilization_percent'] .chart[data-drawn='1']").wait_for()
    page.locator("[data-testid='time-shares'] .chart[data-drawn='1']").wait_for()
    shot(page, "infra", tmp_path_factory)
    go(page, "topology?runs=syn")
    assert "synthetic-node" in page.get_by_test_id("machines").inner_text()
    go(page, "evals?runs=syn")
    page.locator("[data-testid='chart-eval/gsm8k_eval/pass@4/correct'] .chart[data-drawn='1']").wait_for()
    page.locator("[data-testid='pass-at-k'] .chart[data-drawn='1']").wait_for()
    page.locator("tr.sample").first.wait_for()  # eval completions, browsable
    go(page, "code?runs=syn&file=project/train.yaml")
    page.get_by_test_id("code-text").get_by_text("seed: 1").wait_for()
    go(page, "code?runs=syn,other&against=other")
    page.get_by_test_id("code-diff").get_by_text("+seed: 1").wait_for()
    go(page, "code?runs=old")
    page.get_by_text("no code snapshot recorded").wait_for()
    go(page, "logs?runs=syn")
    page.get_by_text("no logs recorded").wait_for()


@pytest.mark.parametrize(
    ("route", "words"),
    [
        ("metrics?runs=broken", "cannot be read"),
        ("rollouts?runs=half", "older or unfinished run"),
        ("rollouts?runs=nope", "no run 'nope'"),
        ("timeline?runs=old", "no timeline events"),
        ("metrics", "No run chosen"),
        ("nowhere?x=%%%", "There is no page"),
        ("rollouts?runs=syn&step=abc", "Pick a step"),
    ],
)
def test_bad_runs_and_urls_show_a_clear_message(page, route, words):
    go(page, route)
    page.get_by_text(words).first.wait_for()


def test_custom_layout_survives_a_server_restart(browser, runs_dir, live_runs, state_dir):
    for attempt in range(2):
        with serve([runs_dir, live_runs], state_dir) as url:
            context = browser.new_context(viewport={"width": 1400, "height": 900})
            pg = context.new_page()
            pg.set_default_timeout(20_000)
            pg.goto(f"{url}/#/metrics?runs=syn&view=custom")
            if attempt == 0:
                pg.locator(".layout-section").first.wait_for()
                pg.get_by_test_id("add-metric").first.fill("trainer/extra/metric_007")
                pg.get_by_test_id("add-metric").first.press("Enter")
            chart = pg.locator("[data-testid='custom-trainer/extra/metric_007'] .chart[data-drawn='1']")
            chart.wait_for()
            order = pg.locator(".layout-section [data-metric]")
            if attempt == 0:  # drag the new chart before the first one
                order.last.drag_to(order.first)
                first = "document.querySelector('.layout-section [data-metric]').dataset.metric"
                pg.wait_for_function(f"{first}.endsWith('metric_007')")
            assert order.first.get_attribute("data-metric") == "trainer/extra/metric_007"
            context.close()
    layout = json.loads((state_dir / "layout.json").read_text())
    assert layout["sections"][0]["metrics"][0] == "trainer/extra/metric_007"


def _rollout(rid: int, step: int) -> Rollout:
    turn = Turn(
        index=0, prompt_ids=[1], completion_ids=[2, 3], completion_text="ok", start_time=1.0, end_time=2.0
    )
    return Rollout(rid, group_id=step, sample_idx=0, env_name="live", turns=[turn], reward=float(step))


def test_live_updates_appear_while_a_run_writes(page, live_runs):
    lock = RunLock.acquire(live_runs / "live")  # as `refractor train` holds it
    store = RunStore(live_runs / "live", config={"model": "m"})
    try:
        for step in range(3):
            store.log_step_metrics(step, {"reward_sum_mean": 0.1 * step, "loss": 1.0 - 0.1 * step})
        store.flush()
        go(page, "metrics?runs=live")
        page.locator("[data-testid='chart-loss'] .chart[data-points='3']").wait_for()
        for step in range(3, 5):
            store.log_step_metrics(step, {"reward_sum_mean": 0.1 * step, "loss": 1.0 - 0.1 * step})
            r = _rollout(step, step)
            r.mark(RolloutStatus.KEPT)
            store.log_rollouts([r], step, step)
        store.flush()
        page.locator("[data-testid='chart-loss'] .chart[data-points='5']").wait_for()  # no reload
        go(page, "rollouts?runs=live&step=4")
        page.locator("tr.sample").first.wait_for()
        assert page.locator("tr.sample").count() == 1
        more = _rollout(100, 4)
        more.mark(RolloutStatus.KEPT)
        store.log_rollouts([more], 4, 4)
        store.flush()
        page.wait_for_function("document.querySelectorAll('tr.sample').length === 2")  # no reload
        go(page, "runs")
        page.locator("tr[data-run='live']").get_by_text("running").wait_for()
    finally:
        store.close()
        lock.release()


LEVEL_ORDER = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# bytes a process may print that are not clean UTF-8 text, decoded as log_capture decodes them
ODD = b"bad \xff\xfe bytes, tab\there, escape \x1b[31mred\x1b[0m".decode("utf-8", "replace")
UNICODE = "naïve café — 日本語 — emoji 🚀 — RTL שלום — combining e\u0301"


def _log_lines(first: int, count: int) -> list[LogLine]:
    """Lines of several components and ranks, every level, one long line and odd characters."""
    sources = [("driver", None, "log"), ("orchestrator", None, "log"), ("trainer", 0, "stdout"),
               ("trainer", 1, "stderr"), ("server", 0, "file")]  # fmt: skip
    lines = []
    for i in range(first, first + count):
        component, rank, source = sources[i % len(sources)]
        message = f"line {i} of {component} step={i // 7}"
        if i == 3:
            message = "LONG " + "x" * 3_990
        elif i == 8:
            message = ODD
        elif i == 11:
            message = UNICODE
        elif i % 4 == 0:
            message += " Loss Spike"
        level = LEVEL_ORDER[(i * 3) % len(LEVEL_ORDER)]
        lines.append(LogLine(1_700_000_000.0 + i, level, component, rank, "10.0.0.1", source, message))
    return lines


def _shown(page) -> list[tuple[str, str, str, str]]:
    """The logs table's rows as (component-rank, level, source, message), read from the DOM text."""
    return [
        tuple(r)
        for r in page.evaluate(
            "[...document.querySelectorAll('[data-testid=logs-table] tbody tr')]"
            ".map(tr => [...tr.cells].slice(1).map(td => td.textContent))"
        )
    ]


def _expected(lines: list[LogLine], component=None, rank=None, level=None, text=None):
    def keep(x: LogLine) -> bool:
        return (
            (component is None or x.component == component)
            and (rank is None or x.rank == rank)
            and (level is None or LEVEL_ORDER.index(x.level) >= LEVEL_ORDER.index(level))
            and (text is None or text.lower() in x.message.lower())
        )

    who = lambda x: x.component if x.rank is None else f"{x.component}-{x.rank}"  # noqa: E731
    return [(who(x), x.level, x.source, x.message) for x in lines if keep(x)]


def _wait_rows(page, want: list) -> None:
    page.wait_for_function(
        f"document.querySelectorAll('[data-testid=logs-table] tbody tr').length === {len(want)}"
    )
    assert _shown(page) == want


def test_logs_page_filters_and_follows_real_log_lines(page, live_runs, tmp_path_factory):
    store = RunStore(live_runs / "logs", config={"model": "m"})
    written = _log_lines(0, 40)
    try:
        store.log_lines(written)
        store.flush()
        go(page, "logs?runs=logs")
        _wait_rows(page, _expected(written))  # every line, long and odd ones unchanged
        assert len(_shown(page)[3][3]) == 3_995
        shot(page, "logs", tmp_path_factory)
        form = page.get_by_test_id("logs-filter")
        form.locator("select[name=level]").select_option("WARNING")
        form.get_by_role("button", name="filter").click()
        page.wait_for_url("**level=WARNING**")
        _wait_rows(page, _expected(written, level="WARNING"))
        form.locator("select[name=level]").select_option("")
        form.locator("input[name=component]").fill("trainer")
        form.locator("input[name=rank]").fill("1")
        form.get_by_role("button", name="filter").click()
        _wait_rows(page, _expected(written, component="trainer", rank=1))
        go(page, "logs?runs=logs&q=loss%20spike")  # text search ignores ASCII case
        _wait_rows(page, _expected(written, text="loss spike"))
        go(page, f"logs?runs=logs&q={UNICODE[6:10]}")
        _wait_rows(page, _expected(written, text=UNICODE[6:10]))
        go(page, "logs?runs=logs&component=trainer&level=ERROR")
        _wait_rows(page, _expected(written, component="trainer", level="ERROR"))
        more = _log_lines(40, 60)  # appended while the page is open: shown without a reload
        store.log_lines(more)
        store.flush()
        _wait_rows(page, _expected(written + more, component="trainer", level="ERROR"))
        assert len(_expected(more, component="trainer", level="ERROR")) > 0
    finally:
        store.close()


def test_timeline_draws_nested_trainer_spans_and_picks_each_level(page, live_runs, tmp_path_factory):
    """A 3-level span tree under a step: each level is drawn inside its parent, and a click picks
    the deepest span drawn at that point, so scanning down the row meets every level in order."""
    t0 = 1_700_000_000.0
    tree = ["step", "checkpoint", "checkpoint/dcp_save", "checkpoint/dcp_save/write"]
    store = RunStore(live_runs / "spans", config={"model": "m"})
    try:
        store.log_events(
            [
                TimelineEvent(n, t0 + i, t0 + 10 - i, "trainer", {"rank": 0, "level": i})
                for i, n in enumerate(tree)
            ],
            step=0,
        )
        store.flush()
    finally:
        store.close()
    go(page, f"timeline?runs=spans&start={t0}&end={t0 + 10}")
    page.locator("[data-testid='gantt'][data-drawn='1']").wait_for()
    box = page.get_by_test_id("gantt").bounding_box()
    label, axis, row = 150, 22, 18  # timeline.js: label column, time axis, rows above the trainer's
    x = box["x"] + label + (box["width"] - label) * 0.5  # t0 + 5 s: inside every span
    picked = []
    for dy in range(0, 30):
        page.mouse.click(x, box["y"] + axis + 2 * row + dy)
        details = page.get_by_test_id("timeline-details")
        if details.count() == 0:
            continue
        name = details.locator("b").inner_text()
        assert f'"level": {tree.index(name)}' in details.locator("pre").inner_text()
        if not picked or picked[-1] != name:
            picked.append(name)
    assert picked == tree
    shot(page, "timeline-nested", tmp_path_factory)
