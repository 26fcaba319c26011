"""The raw-token route on a real run store whose config points at the tiny offline model's
tokenizer: each turn's ids decoded with special tokens kept, a missing tokenizer, unknown rollouts."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from refractor.records import Rollout, RolloutStatus, Turn, append_turn_tokens
from refractor.telemetry.store import RunStore
from refractor.testing import tiny_qwen2
from refractor.ui import create_app


def two_turn_rollout(rid: int, tok) -> Rollout:
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    prompt = [start, *tok.encode("user\nadd 1 and 2", add_special_tokens=False), end, start]
    c0 = [*tok.encode("assistant\n3", add_special_tokens=False), end]
    glue = [start, *tok.encode("user\nagain", add_special_tokens=False), end, start]
    c1 = [*tok.encode("assistant\nstill 3", add_special_tokens=False), end]
    r = Rollout(rollout_id=rid, group_id=0, sample_idx=0, env_name="countdown", prompt_text="add 1 and 2")
    t0 = Turn(0, prompt, c0, [-0.1] * len(c0), "stop", "3", start_version=0, end_version=0)
    t1 = Turn(1, prompt + c0 + glue, c1, [-0.1] * len(c1), "stop", "still 3", start_version=0, end_version=0)
    for t in (t0, t1):
        r.turns.append(t)
        append_turn_tokens(r, t)
    r.mark(RolloutStatus.KEPT, "")
    return r


@pytest.fixture(scope="module")
def model_path():
    return str(tiny_qwen2())


@pytest.fixture(scope="module")
def runs(model_path, tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(model_path)
    runs = tmp_path_factory.mktemp("tok") / "runs"
    for name, model in (("real", model_path), ("gone", str(runs / "no-such-model"))):
        store = RunStore(runs / name, config={"model": model, "group_size": 1})
        store.log_rollouts([two_turn_rollout(0, tok)], trainer_step=0, inference_step=0)
        store.close()
    return runs


@pytest.fixture(scope="module")
def client(runs, tmp_path_factory):
    app = create_app([runs], tmp_path_factory.mktemp("state"))
    with TestClient(app) as c:
        yield c


def test_turns_decode_with_special_tokens_kept(client, model_path):
    tok = AutoTokenizer.from_pretrained(model_path)
    assert "<|im_start|>" in [str(t) for t in tok.added_tokens_decoder.values()]  # one token, not bytes
    resp = client.get("/api/runs/real/rollouts/0/tokens")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["split"] is True and body["tokenizer"] == model_path
    t0, t1 = body["turns"]
    assert t0["turn_idx"] == 0 and t0["input_ids"] is None and t0["input_text"] is None
    assert t1["turn_idx"] == 1 and t1["input_ids"][0] == tok.convert_tokens_to_ids("<|im_start|>")
    for seg in (t0, t1):
        assert seg["completion_text"] == tok.decode(seg["completion_ids"], skip_special_tokens=False)
    assert t1["input_text"] == tok.decode(t1["input_ids"], skip_special_tokens=False)
    assert t0["completion_text"].endswith("<|im_end|>")
    assert t1["input_text"].startswith("<|im_start|>user")
    assert t1["completion_text"] == "assistant\nstill 3<|im_end|>"


def test_missing_tokenizer_and_unknown_rollout_are_404(client, tmp_path_factory):
    resp = client.get("/api/runs/gone/rollouts/0/tokens")
    assert resp.status_code == 404
    assert "tokenizer at" in resp.json()["error"] and "not available on this machine" in resp.json()["error"]
    resp = client.get("/api/runs/real/rollouts/99/tokens")
    assert resp.status_code == 404 and "no rollout 99" in resp.json()["error"]


def test_tokens_toggle_shows_special_tokens_in_the_browser(runs, tmp_path_factory):
    playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is part of the dev extra")
    from refractor.ui.local import chromium_path
    from refractor.ui.local import serve_in_thread as serve

    if chromium_path() is None:
        pytest.skip("no system Chromium (apt-get install chromium)")
    with serve([runs], tmp_path_factory.mktemp("state")) as url, playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        page = browser.new_page()
        page.set_default_timeout(20_000)
        errors = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.goto(f"{url}/#/rollouts?runs=real&step=0&rollout=0")
        page.get_by_test_id("rollout-detail").wait_for()
        page.get_by_test_id("tokens-toggle").check()
        page.wait_for_url("**tokens=1**")
        view = page.get_by_test_id("tokens-view")
        view.get_by_test_id("tokens-completion").first.wait_for()
        assert "assistant\nstill 3<|im_end|>" in view.inner_text()
        assert view.get_by_test_id("tokens-input").inner_text().startswith("<|im_start|>user")
        page.goto(f"{url}/#/rollouts?runs=gone&step=0&rollout=0&tokens=1")
        page.get_by_text("not available on this machine").wait_for()
        browser.close()
        assert not errors, errors
