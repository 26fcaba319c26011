"""The dashboard's JSON API on synthetic run stores, a damaged one, a half-written one and one of
an older schema: answers, derived metrics against the Python reference, bad input as 4xx."""

from __future__ import annotations

import json
import math

import pytest
from fastapi.testclient import TestClient

from refractor.telemetry.metrics import rollout_step_metrics
from refractor.telemetry.query import RunReader
from refractor.ui import create_app


@pytest.fixture(scope="module")
def client(runs_dir, tmp_path_factory):
    app = create_app([runs_dir], tmp_path_factory.mktemp("state"))
    with TestClient(app) as c:
        yield c


def ok(client, url, **params):
    resp = client.get(url, params=params)
    assert resp.status_code == 200, (url, resp.status_code, resp.text)
    return resp.json()


def test_runs_lists_every_run_with_its_status_and_progress(client):
    runs = {r["id"]: r for r in ok(client, "/api/runs")["runs"]}
    assert set(runs) == {"syn", "other", "broken", "half", "old"}
    assert runs["syn"]["status"] == "finished" and runs["syn"]["steps"] == 20
    assert runs["syn"]["model"] == "synthetic/tiny-model" and runs["syn"]["algorithm"] == "grpo"
    assert runs["syn"]["last_reward"] is not None
    assert runs["other"]["status"] == "crashed"  # stored `running`, but nobody holds its lock
    assert runs["broken"]["status"] == "unreadable" and "cannot be read" in runs["broken"]["error"]
    assert runs["old"]["steps"] == 2 and runs["old"]["last_reward"] == 0.5


def test_run_detail_says_which_data_the_run_has(client):
    syn = ok(client, "/api/runs/syn")
    assert syn["has"] == {
        "rollouts": True,
        "evals": True,
        "events": True,
        "system_metrics": True,
        "code": True,
        "logs": False,
        "topology": True,
    }
    assert syn["envs"] == ["code_tools", "countdown", "math"]
    old = ok(client, "/api/runs/old")
    assert old["has"]["rollouts"] is False and old["has"]["code"] is False


def test_config_diff_and_search(client):
    diff = {d["key"]: d for d in ok(client, "/api/config-diff", a="syn", b="old")["diff"]}
    assert diff["learning_rate"]["a"] == 1e-6 and diff["learning_rate"]["b"] == 0.001
    assert diff["group_size"]["only"] == "a"
    assert "model" in diff
    assert set(ok(client, "/api/search", q="learning_rate=1e-6,loss_type=grpo")["runs"]) == {"syn", "other"}
    assert ok(client, "/api/search", q="learning_rate=0.001")["runs"] == ["old"]
    assert set(ok(client, "/api/search", q="environments.0.name=countdown")["runs"]) == {"other", "syn"}
    assert client.get("/api/search", params={"q": "nonsense"}).status_code == 400


def test_metric_catalogue_and_series(client):
    names = ok(client, "/api/runs/syn/metric-names")["names"]
    by_name = {n["name"]: n for n in names}
    assert by_name["trainer/extra/metric_000"] == {
        "name": "trainer/extra/metric_000",
        "section": "trainer",
        "group": "extra",
        "metric": "metric_000",
    }
    assert by_name["reward_sum_mean"]["section"] == ""
    data = ok(client, "/api/runs/syn/metrics", names="reward_sum_mean,loss")["series"]
    assert data["loss"]["steps"] == list(range(20))
    newer = ok(client, "/api/runs/syn/metrics", names="loss", since=17)["series"]["loss"]
    assert newer["steps"] == [18, 19] and newer["values"] == data["loss"]["values"][18:]


def test_derived_metrics_match_the_python_reference_per_environment(client, runs_dir):
    for chosen in (("math", "countdown"), ("code_tools",), None):  # None: every environment
        derived = ok(client, "/api/runs/syn/derived", envs=",".join(chosen or ()))["series"]
        with RunReader(runs_dir / "syn") as reader:
            for step in (0, 7, 19):
                rows = [r for r in reader.rollout_summaries(step) if r.status != "eval"]
                envs = {r["rollout_id"]: r["env"] for r in reader.rollouts(step=step)}
                ids = [r["rollout_id"] for r in reader.rollouts(step=step) if r["status"] != "eval"]
                picked = [s for s, i in zip(rows, ids, strict=True) if chosen is None or envs[i] in chosen]
                expected = rollout_step_metrics(picked)
                for name in (
                    "reward_sum_mean",
                    "reward_sum_std",
                    "reward_correct_mean",
                    "reward_format_std",
                    "reward_format_min",
                    "length_completion_max",
                    "length_sum_mean",
                    "advantage_std",
                    "stop_reason_length_pct",
                    "off_policy_steps_mean",
                    "reward_gini_mean",
                    "group_length_gini_mean",
                    "discarded_count",
                    "discarded_zero_advantage_count",
                    "canceled_count",
                ):
                    got = dict(zip(derived[name]["steps"], derived[name]["values"], strict=True)).get(step)
                    want = expected.get(name)
                    assert (got is None and want is None) or math.isclose(
                        got, want, rel_tol=1e-9, abs_tol=1e-9
                    ), (chosen, step, name, got, want)


def test_trainer_time_shares_add_up_to_the_step(client):
    shares = ok(client, "/api/runs/syn/time-shares")["series"]
    assert {"forward", "backward", "optimizer", "weight_sync", "waiting_for_data", "idle"} <= set(shares)
    at = {name: dict(zip(s["steps"], s["values"], strict=True))[3] for name, s in shares.items()}
    assert math.isclose(sum(at.values()), 100.0) or at["idle"] == 0.0
    assert math.isclose(at["forward"], 80.0 * 4 / 14)  # 4 of the 14 equal trainer spans of 80% of the step


def test_histograms_and_distribution_over_steps(client):
    hist = ok(client, "/api/runs/syn/histogram", field="completion_tokens", step=3)
    kept = ok(client, "/api/runs/syn/steps/3/rollouts", limit=1000)["total"]
    assert sum(hist["counts"]) == kept and len(hist["edges"]) == 31
    dist = ok(client, "/api/runs/syn/distribution", field="reward")
    assert len(dist["steps"]) == 20 and sum(map(sum, dist["counts"])) > 0
    assert client.get("/api/runs/syn/histogram", params={"field": "prompt_text"}).status_code == 400


def test_rollouts_of_a_step_filter_sort_and_page(client):
    page = ok(client, "/api/runs/syn/steps/5/rollouts")
    assert page["total"] == len(page["rollouts"]) > 0
    assert all(r["status"] == "kept" and r["step"] == 5 for r in page["rollouts"])
    assert set(page["envs"]) <= {"math", "countdown", "code_tools"}
    good = ok(client, "/api/runs/syn/steps/5/rollouts", reward_min=0.5)["rollouts"]
    assert good and all(r["reward"] >= 0.5 for r in good)
    by_len = ok(client, "/api/runs/syn/steps/5/rollouts", sort="length", desc=True)["rollouts"]
    lengths = [r["completion_tokens"] for r in by_len]
    assert lengths == sorted(lengths, reverse=True)
    second = ok(client, "/api/runs/syn/steps/5/rollouts", offset=2, limit=2)["rollouts"]
    assert [r["rollout_id"] for r in second] == [r["rollout_id"] for r in page["rollouts"][2:4]]
    code = ok(client, "/api/runs/syn/steps/5/rollouts", env="code_tools")["rollouts"]
    assert code and {r["env"] for r in code} == {"code_tools"}
    text = ok(client, "/api/runs/syn/steps/5/rollouts", q="Answer: ")["rollouts"]
    assert text and all("Answer: " in r["completion_text"] for r in text)
    assert ok(client, "/api/runs/syn/steps/5/rollouts", q="%_no such text_%")["total"] == 0


def test_discarded_and_cancelled_rollouts_come_with_reasons(client, runs_dir):
    with RunReader(runs_dir / "syn") as reader:
        step = next(r["step"] for r in reader.rollouts(status="discarded"))
    page = ok(client, f"/api/runs/syn/steps/{step}/rollouts", status="discarded,cancelled")
    assert page["rollouts"] and all(r["reason"] for r in page["rollouts"])
    assert "zero_advantage" in page


def test_one_rollout_comes_with_turns_and_tool_calls(client):
    (first,) = ok(client, "/api/runs/syn/steps/2/rollouts", env="code_tools", limit=1)["rollouts"]
    rollout = ok(client, f"/api/runs/syn/rollouts/{first['rollout_id']}")
    assert rollout["num_turns"] == len(rollout["turns"]) == 3
    call = rollout["turns"][0]["tool_calls"][0]
    assert call["tool_name"] == "python" and "code" in call["arguments"] and call["extra"]["exit_code"] == 0
    assert rollout["turns"][0]["env_messages"][0]["role"] == "tool"


def test_evals_list_their_steps_and_metrics(client):
    evals = ok(client, "/api/runs/syn/evals")
    assert evals["evals"] == {"gsm8k_eval": [10, 20]}
    assert "eval/gsm8k_eval/pass@4/correct" in evals["metrics"]
    page = ok(client, "/api/runs/syn/steps/10/rollouts", status="eval")
    assert page["total"] == 8


def test_timeline_window_holds_events_and_lane_rollouts(client):
    bounds = ok(client, "/api/runs/syn/time-bounds")
    start = bounds["start"]
    window = ok(client, "/api/runs/syn/timeline", start=start + 20, end=start + 30)
    events = window["events"]
    assert events["id"] and not window["truncated"]
    assert all(e >= start + 20 for e in events["end"]) and all(s <= start + 30 for s in events["start"])
    assert set(events["component"]) >= {"trainer", "orchestrator"}
    assert json.loads(events["attrs"][0])["step"] >= 0
    lanes = window["lanes"]
    assert lanes["rollouts"]["rollout_id"] and set(lanes["turns"]["rollout_id"]) == set(
        lanes["rollouts"]["rollout_id"]
    )
    small = ok(client, "/api/runs/syn/timeline", start=start, end=bounds["end"], limit=10)
    assert small["truncated"] and len(small["events"]["id"]) == 10
    # zoomed out: sub-pixel spans and busy instants are left out, milestones stay
    wide = ok(client, "/api/runs/syn/timeline", start=start, end=bounds["end"], min_duration=1.0)["events"]
    assert (
        "save_batch" in wide["name"]
        and "inference_call" not in wide["name"]
        and "forward" not in wide["name"]
    )
    assert all(e - s >= 1.0 or s == e for s, e in zip(wide["start"], wide["end"], strict=True))


def test_system_metrics_are_sampled_to_the_points_asked(client):
    bounds = ok(client, "/api/runs/syn/time-bounds")
    names = ok(client, "/api/runs/syn/system-names")["metrics"]
    assert {"source": "gpu0", "name": "gpu_utilization_percent", "node": "10.0.0.1"} in names
    data = ok(
        client,
        "/api/runs/syn/system",
        name="gpu_utilization_percent",
        start=bounds["system_start"],
        end=bounds["system_end"],
        points=20,
    )["series"]
    assert set(data) == {"gpu0@10.0.0.1", "gpu1@10.0.0.1"}
    assert 15 <= len(data["gpu0@10.0.0.1"]["time"]) <= 20
    old = ok(client, "/api/runs/old/system", name="cpu_utilization_percent", start=1.6e9, end=1.6e9 + 10)
    assert old["series"] == {"system": {"time": [1600000001.0], "value": [12.5]}}


def test_a_run_of_an_older_schema_has_an_empty_timeline_not_an_error(client):
    bounds = ok(client, "/api/runs/old/time-bounds")
    assert bounds["start"] is None and bounds["system_start"] == 1600000001.0
    window = ok(client, "/api/runs/old/timeline", start=1.6e9, end=1.6e9 + 10)
    assert window["events"]["id"] == [] and window["lanes"]["rollouts"]["rollout_id"] == []


def test_topology_code_snapshot_and_a_run_without_logs(client):
    assert ok(client, "/api/runs/syn/topology")["topology"]["trainer"]["world_size"] == 2
    code = ok(client, "/api/runs/syn/code")
    assert code["info"]["roots"][0]["label"] == "project"
    assert [f["path"] for f in code["files"]] == ["environments/countdown/env.py", "train.yaml"]
    assert "seed: 1" in ok(client, "/api/runs/syn/code/file", root="project", path="train.yaml")["text"]
    diff = ok(client, "/api/code-diff", a="syn", b="other")
    assert [c["path"] for c in diff["changed"]] == ["train.yaml"] and "+seed: 2" in diff["changed"][0]["diff"]
    assert ok(client, "/api/runs/old/code") == {"info": None, "files": []}
    assert ok(client, "/api/runs/syn/logs")["logs"] == []  # a logs table with no line yet
    resp = client.get("/api/runs/old/logs")  # a run store from before the logs table
    assert resp.status_code == 409 and "no logs recorded" in resp.json()["error"]


def test_live_cursor_reports_the_newest_rows(client):
    cur = ok(client, "/api/runs/syn/cursor")
    assert cur["step"] == 20 and cur["rollout"] > 0 and cur["event"] > 0 and cur["status"] == "finished"
    old = ok(client, "/api/runs/old/cursor")  # an older store: what it lacks reads None
    assert old["step"] == 1 and old["rollout"] is None and old["log"] is None


@pytest.mark.parametrize(
    ("url", "status", "words"),
    [
        ("/api/runs/nope", 404, "no run 'nope'"),
        ("/api/runs/broken", 422, "cannot be read"),
        ("/api/runs/broken/metric-names", 422, "cannot be read"),
        ("/api/runs/half", 409, "older or unfinished run"),
        ("/api/runs/half/steps/0/rollouts", 409, "older or unfinished"),
        ("/api/runs/old/steps/0/rollouts", 409, "older or unfinished"),
        ("/api/runs/syn/steps/abc/rollouts", 400, "step"),
        ("/api/runs/syn/steps/1/rollouts?limit=-5", 400, "limit"),
        ("/api/runs/syn/steps/1/rollouts?sort=reward;DROP", 400, "sort"),
        ("/api/runs/syn/steps/1/rollouts?status=everything", 400, "status"),
        ("/api/runs/syn/steps/1/rollouts?reward_min=lots", 400, "reward_min"),
        ("/api/runs/syn/rollouts/999999999", 404, "no rollout"),
        ("/api/runs/syn/timeline?start=5&end=1", 400, "window"),
        ("/api/runs/syn/timeline?start=nan&end=1", 400, ""),
        ("/api/runs/syn/metrics", 400, "names"),
        ("/api/config-diff?a=syn&b=..%2F..%2Fetc", 404, "no run"),
        ("/api/runs/syn/code/file?root=project&path=../../etc/passwd", 404, "no file"),
        ("/api/runs/%2e%2e/cursor", 404, ""),
    ],
)
def test_bad_input_is_a_4xx_with_one_line_reason(client, url, status, words):
    resp = client.get(url)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert words in error and "\n" not in error


@pytest.mark.parametrize(
    "path",
    [
        "/static/../../../etc/passwd",
        "/static/%2e%2e/%2e%2e/etc/passwd",
        "/static/..%2fapp.py",
        "/static/../app.py",
        "/../../etc/passwd",
        "/static//etc/passwd",
        "/openapi.json",
        "/docs",
        "/api/../../../etc/passwd",
    ],
)
def test_only_the_static_folder_is_served(client, path):
    resp = client.get(path)
    assert resp.status_code == 404
    assert b"root:" not in resp.content and b"create_app" not in resp.content


def test_notes_and_hidden_runs_are_kept_in_the_state_folder_not_the_run_store(client, runs_dir):
    before = (runs_dir / "syn" / "run.db").stat().st_mtime_ns
    assert (
        client.put("/api/state/notes", json={"run": "syn", "text": "lr sweep, best so far"}).status_code
        == 200
    )
    assert client.put("/api/state/hidden", json={"run": "old", "hidden": True}).status_code == 200
    runs = {r["id"]: r for r in ok(client, "/api/runs")["runs"]}
    assert runs["syn"]["note"] == "lr sweep, best so far" and runs["old"]["hidden"]
    assert client.put("/api/state/hidden", json={"run": "old", "hidden": False}).status_code == 200
    assert client.put("/api/state/notes", json={"run": "nope", "text": "x"}).status_code == 404
    assert client.put("/api/state/layout", json={"sections": "garbage"}).status_code == 400
    assert (runs_dir / "syn" / "run.db").stat().st_mtime_ns == before


def test_a_runs_dir_with_500_runs_lists_them_all(tmp_path):
    import sqlite3

    for i in range(500):
        (tmp_path / f"run{i:03d}").mkdir()
        conn = sqlite3.connect(tmp_path / f"run{i:03d}" / "run.db")
        conn.executescript(
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
            "CREATE TABLE step_metrics (step INTEGER, name TEXT, value REAL, time REAL);"
            f"INSERT INTO meta VALUES ('status', '\"finished\"'), ('created_at', '{1e9 + i}');"
            f"INSERT INTO step_metrics VALUES (0, 'reward_sum_mean', {i / 500}, 0);"
        )
        conn.close()
    with TestClient(create_app([tmp_path], tmp_path / "state")) as c:
        runs = ok(c, "/api/runs")["runs"]
        assert len(runs) == 500 and runs[0]["id"] == "run499" and runs[0]["last_reward"] == 499 / 500
        assert ok(c, "/api/runs")["runs"] == runs  # the second listing reads no store again (cached)


def test_logs_are_listed_with_filters_when_the_store_has_them(tmp_path):
    from refractor.telemetry.log_capture import LogLine
    from refractor.telemetry.store import RunStore
    from refractor.telemetry.synthetic import SyntheticSpec, write_synthetic_run

    run = write_synthetic_run(tmp_path / "runs" / "logged", SyntheticSpec(steps=2, rollouts_per_step=8))
    store = RunStore(run)  # the run's writer adds the logs table to the synthetic store
    store.log_lines(
        [
            LogLine(1.0, "INFO", "orchestrator", None, "10.0.0.1", "log", "step 0 done"),
            LogLine(2.0, "WARNING", "server", 0, "10.0.0.2", "file", "slow request"),
            LogLine(3.0, "INFO", "trainer", 0, "10.0.0.1", "stdout", "step 1 done"),
        ]
    )
    store.close()
    with TestClient(create_app([tmp_path / "runs"], tmp_path / "state")) as c:
        assert ok(c, "/api/runs/logged")["has"]["logs"]
        first = ok(c, "/api/runs/logged/logs")
        assert [r["message"] for r in first["logs"]] == ["step 0 done", "slow request", "step 1 done"]
        assert {(s["component"], s["rank"], s["lines"]) for s in first["summary"]} == {
            ("orchestrator", None, 1),
            ("server", 0, 1),
            ("trainer", 0, 1),
        }
        assert [r["message"] for r in ok(c, "/api/runs/logged/logs", level="warning")["logs"]] == [
            "slow request"
        ]
        assert [r["component"] for r in ok(c, "/api/runs/logged/logs", q="done", after=1)["logs"]] == [
            "trainer"
        ]
        assert [r["source"] for r in ok(c, "/api/runs/logged/logs", component="trainer", rank=0)["logs"]] == [
            "stdout"
        ]
        resp = c.get("/api/runs/logged/logs", params={"level": "LOUD"})
        assert resp.status_code == 400 and "level must be one of" in resp.json()["error"]


def test_normalised_sample_metrics_match_a_float64_reference(tmp_path):
    """Each kept rollout's sample metric normalised by its environment's ``metrics_ranges`` entry
    ((v - min) / (max - min), 1 minus that when inverted; [0, 1] without one), then per step: mean,
    sample std, min, max, computed here in plain Python float64 from the values written."""
    import itertools
    import random
    import statistics

    from refractor.records import Rollout, RolloutStatus
    from refractor.records.rollout import Turn
    from refractor.telemetry.store import RunStore

    envs = [
        {"name": "alpha", "metrics_ranges": {"score": {"min": -2.0, "max": 6.0, "invert": False}}},
        {
            "name": "beta",
            "metrics_ranges": {"score": {"min": 10, "max": 20, "invert": True}, "bad": {"min": 1}},
        },
    ]
    ranges = {("alpha", "score"): (-2.0, 6.0, False), ("beta", "score"): (10.0, 20.0, True)}
    rng = random.Random(7)
    store = RunStore(tmp_path / "runs" / "norm", config={"model": "m"})
    store.set_meta({"environments": envs})
    written: list[tuple[int, str, str, float]] = []  # step, env, metric, value of the kept rollouts
    rid = 0
    for step in range(3):
        batch = []
        for i in range(24):
            env = ("alpha", "beta")[i % 2]
            metrics = {"score": rng.uniform(-3, 25), "bad": rng.uniform(0, 2), "plain": rng.gauss(5, 3)}
            turn = Turn(
                index=0, prompt_ids=[1], completion_ids=[2], completion_text="x", start_time=1.0, end_time=2.0
            )
            r = Rollout(
                rid, group_id=i // 4, sample_idx=i % 4, env_name=env, turns=[turn], sample_metrics=metrics
            )
            r.mark(RolloutStatus.DISCARDED if i % 5 == 0 else RolloutStatus.KEPT)
            if i % 5:
                written += [(step, env, k, v) for k, v in metrics.items()]
            batch.append(r)
            rid += 1
        store.log_rollouts(batch, step, step)
    store.close()

    def normalised(env: str, metric: str, v: float) -> float:
        lo, hi, invert = ranges.get((env, metric), (0.0, 1.0, False))
        t = (v - lo) / (hi - lo)
        return 1.0 - t if invert else t

    def at(series: dict, name: str, step: int) -> float:
        return dict(zip(series[name]["steps"], series[name]["values"], strict=True))[step]

    with TestClient(create_app([tmp_path / "runs"], tmp_path / "state")) as c:
        beta = ok(c, "/api/runs/norm")["metric_ranges"]["beta"]
        assert beta == {"score": {"lo": 10.0, "hi": 20.0, "invert": True}}  # "bad" has no max
        for chosen in ("", "beta"):
            normal = ok(c, "/api/runs/norm/derived", envs=chosen, normalise="1")["series"]
            raw = ok(c, "/api/runs/norm/derived", envs=chosen)["series"]
            for step, metric in itertools.product(range(3), ("score", "bad", "plain")):
                picked = [(e, v) for s, e, k, v in written if (s, k) == (step, metric) and chosen in ("", e)]
                values = [normalised(e, metric, v) for e, v in picked]
                want = {
                    "mean": math.fsum(values) / len(values),
                    "std": statistics.stdev(values),
                    "min": min(values),
                    "max": max(values),
                }
                for stat, expected in want.items():
                    got = at(normal, f"reward_{metric}_{stat}", step)
                    assert math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12), (metric, stat, step)
                raw_mean = math.fsum(v for _, v in picked) / len(picked)  # without the option: as written
                assert math.isclose(at(raw, f"reward_{metric}_mean", step), raw_mean, rel_tol=1e-12)
