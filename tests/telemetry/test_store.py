"""Run store round trip, and a reader that keeps reading while the writer writes."""

import threading
import time

import pytest

from refractor.records import (
    EvalRollout,
    Rollout,
    RolloutStatus,
    TimelineEvent,
    ToolCall,
    Turn,
    append_turn_tokens,
)
from refractor.telemetry.metrics import rollout_step_metrics
from refractor.telemetry.query import RunReader, list_runs
from refractor.telemetry.store import SCHEMA_VERSION, RunStore


def make_rollout(rid, group, status=RolloutStatus.KEPT, reason="", reward=1.0, record=Rollout, **fields):
    r = record(
        rollout_id=rid,
        group_id=group,
        sample_idx=rid % 2,
        env_name="countdown",
        prompt_text=f"q{rid}",
        prompt_index=7 * group,
        prompt_ordinal=group,
        server="s0",
        lane=rid % 4,
        reward=reward,
        advantage=reward - 0.5,
        sample_metrics={"correct": reward},
        **fields,
    )
    t0 = Turn(
        0,
        [1, 2, 3],
        [4, 5],
        [-0.1, -0.2],
        "stop",
        "ab",
        start_version=0,
        end_version=1,
        env_messages=[{"role": "user", "content": "again"}],
        tool_calls=[ToolCall("calc", '{"x": 1}', "2", True, "", {"exit_code": 0})],
    )
    t1 = Turn(1, [1, 2, 3, 4, 5, 9], [6], [-0.3], "length", "c", start_version=1, end_version=2)
    for t in (t0, t1):
        r.turns.append(t)
        append_turn_tokens(r, t)
    r.stop_reason = "length"
    r.first_start_version = 0
    r.off_policy_steps = 2
    r.mark(status, reason)
    return r


def test_round_trip(tmp_path):
    store = RunStore(tmp_path / "runs" / "r1", config={"learning_rate": 1e-6, "group_size": 2})
    kept = [make_rollout(0, 0, reward=1.0), make_rollout(1, 0, reward=0.0)]
    store.log_rollouts(kept, trainer_step=0, inference_step=0)
    store.log_rollouts([make_rollout(2, 1, RolloutStatus.DISCARDED, "zero_advantage", 0.0)], 0, 0)
    store.log_rollouts([make_rollout(3, 2, RolloutStatus.CANCELLED, "off_policy", 0.0)], 0, 1)
    store.log_step_metrics(0, {"reward_sum_mean": 0.5, "grad_norm": 1.25})
    store.log_step_metrics(1, {"reward_sum_mean": 0.75})
    store.log_events(
        [
            TimelineEvent("train_step", 10.0, 12.0, "trainer", {"step": 0}),
            TimelineEvent("weight_sync", 12.0, 12.5, "inference", {"server": "s0"}),
        ],
        step=0,
    )
    store.log_system_metrics("driver", {"cpu_utilization_percent": 50.0}, timestamp=11.0)
    store.close()

    runs = list_runs(tmp_path / "runs")
    assert [(r.name, r.status, r.last_step) for r in runs] == [("r1", "finished", 1)]
    with RunReader(tmp_path / "runs" / "r1") as reader:
        assert reader.config() == {"learning_rate": 1e-6, "group_size": 2}
        assert reader.step_metrics() == [
            {"step": 0, "reward_sum_mean": 0.5, "grad_norm": 1.25},
            {"step": 1, "reward_sum_mean": 0.75},
        ]
        assert reader.step_metrics(["grad_norm"]) == [{"step": 0, "grad_norm": 1.25}]
        rows = reader.rollouts(step=0)
        assert [(r["rollout_id"], r["status"], r["reason"]) for r in rows] == [
            (0, "kept", ""),
            (1, "kept", ""),
            (2, "discarded", "zero_advantage"),
        ]
        r0 = rows[0]
        assert (r0["prompt_tokens"], r0["completion_tokens"], r0["total_tokens"]) == (
            3,
            3,
            3 + 4,
        )  # completion = 4 5 | 9 (env glue) | 6
        assert (r0["start_version"], r0["end_version"], r0["off_policy_steps"]) == (0, 2, 2)
        assert r0["sample_metrics"] == {"correct": 1.0} and r0["completion_text"] == "ab\nc"
        assert r0["completion_ids"] == [4, 5, 9, 6]  # the trained sequence, env glue included
        assert (rows[2]["prompt_index"], rows[2]["prompt_ordinal"]) == (7, 1)
        assert reader.rollouts(status="cancelled")[0]["step"] == 1
        turns = reader.turns(0)
        assert [t["finish_reason"] for t in turns] == ["stop", "length"]
        assert turns[0]["env_messages"] == [{"role": "user", "content": "again"}]
        assert turns[0]["tool_calls"][0]["tool_name"] == "calc" and turns[1]["tool_calls"] == []
        assert [e["name"] for e in reader.timeline(start=12.2)] == ["weight_sync"]
        assert [e["name"] for e in reader.timeline(end=11.0)] == ["train_step"]
        assert reader.system_metrics()[0]["value"] == 50.0
        # the dashboard's derived metrics come from the same function as the orchestrator's
        m = rollout_step_metrics(reader.rollout_summaries(0))
        assert m["reward_sum_mean"] == 0.5 and m["discarded_zero_advantage_count"] == 1


def test_eval_rows_are_stored_under_their_eval_step_and_training_rows_under_the_step_filled(tmp_path):
    store = RunStore(tmp_path / "r")
    eval_row = make_rollout(10, 10, RolloutStatus.EVAL, reward=0.0, record=EvalRollout, step=3)
    store.log_rollouts([eval_row, make_rollout(11, 11)], trainer_step=5, inference_step=6)
    store.close()
    with RunReader(tmp_path / "r") as reader:
        rows = reader.rollouts()
    assert [(r["rollout_id"], r["status"], r["step"]) for r in rows] == [(10, "eval", 3), (11, "kept", 6)]


def test_reader_never_blocks_while_writing(tmp_path):
    store = RunStore(tmp_path / "r")
    store.log_step_metrics(0, {"x": 0.0})
    store.flush()
    reader = RunReader(tmp_path / "r")
    seen = []
    errors = []
    stop = threading.Event()

    def read_loop():
        try:
            while not stop.is_set():
                t = time.perf_counter()
                rows = reader.step_metrics()
                seen.append((len(rows), time.perf_counter() - t))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    th = threading.Thread(target=read_loop)
    th.start()
    for step in range(1, 300):
        store.log_step_metrics(step, {"x": float(step), "y": 2.0 * step})
        store.log_rollouts([make_rollout(step, step)], trainer_step=step, inference_step=step)
        if step % 50 == 0:
            store.flush()
    store.flush()
    stop.set()
    th.join()
    store.close()
    assert not errors
    counts = [n for n, _ in seen]
    assert len(seen) > 10 and counts == sorted(counts)  # snapshots only ever grow
    assert max(dt for _, dt in seen) < 1.0
    assert len(reader.step_metrics()) == 300 and len(reader.rollouts()) == 299
    reader.close()


def test_a_store_without_telemetry_keeps_only_what_training_needs(tmp_path):
    """``record_telemetry: false``: step metrics, rollouts and run state are written; events, rollout
    spans, system metrics and log lines handed to the store are dropped."""
    from refractor.telemetry.log_capture import LogLine

    store = RunStore(tmp_path, run_name="bare", record_telemetry=False)
    store.log_step_metrics(0, {"loss": 0.5})
    store.log_rollouts([make_rollout(0, 0), make_rollout(1, 0)], trainer_step=0, inference_step=0)
    store.log_events(
        [
            TimelineEvent("step", 1.0, 2.0, "trainer", {"rank": 0}),
            TimelineEvent("generation", 1.0, 1.5, "rollout", {"rollout_id": 0, "server": "s0"}),
        ]
    )
    store.log_system_metrics("system", {"cpu_percent": 3.0}, node="10.0.0.1")
    store.log_lines([LogLine(1.0, "INFO", "driver", None, "10.0.0.1", "log", "hello")])
    store.close()
    with RunReader(tmp_path) as r:
        assert r.step_metric(0, "loss") == 0.5 and len(r.rollouts()) == 2
        assert r.meta()["status"] == "finished"
        assert r.timeline() == [] and r.system_metrics() == [] and r.logs() == []


def test_closed_store_rejects_writes(tmp_path):
    store = RunStore(tmp_path / "r")
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.log_step_metrics(0, {"x": 1.0})


def test_reopening_a_run_keeps_creation_time_and_marks_it_running(tmp_path):
    RunStore(tmp_path / "r").close()
    with RunReader(tmp_path / "r") as reader:
        first = reader.meta()
    store = RunStore(tmp_path / "r")
    store.flush()
    with RunReader(tmp_path / "r") as reader:
        again = reader.meta()
    store.close()
    assert first["status"] == "finished" and again["status"] == "running"
    assert again["created_at"] == first["created_at"]


def test_a_resumed_run_abandons_what_the_dead_attempt_wrote_for_the_steps_it_redoes(tmp_path):
    """Killed after filling step 2 (evals reported at steps 1-3), resumed from the checkpoint saved
    after step 1: step 2's training rows and the eval after step 2 are history; steps 0-1, and the
    eval at step 2 (run on the checkpointed weights), stay."""
    store = RunStore(tmp_path / "r")
    for step in range(3):
        rows = [make_rollout(10 * step + i, 10 * step, reward=float(i)) for i in range(2)]
        rows.append(
            make_rollout(10 * step + 5, 10 * step + 5, RolloutStatus.DISCARDED, reason="zero_advantage")
        )
        store.log_rollouts(rows, trainer_step=step, inference_step=step)
        store.log_step_metrics(step, {"loss": float(step), "eval/countdown/correct": 0.5 + step})
    store.log_rollouts(
        [make_rollout(100 + s, 100 + s, RolloutStatus.EVAL, record=EvalRollout, step=s) for s in (1, 2, 3)],
        trainer_step=3,
        inference_step=3,
    )
    store.close()

    resumed = RunStore(tmp_path / "r")
    resumed.abandon_unfinished(2, "the run was resumed from checkpoint step_1")
    resumed.log_rollouts([make_rollout(20, 20, reward=1.0)], trainer_step=2, inference_step=2)  # redone
    resumed.close()
    with RunReader(tmp_path / "r") as reader:
        status = {r["rollout_id"]: (r["status"], r["step"]) for r in reader.rollouts()}
        metrics = {m["step"]: m for m in reader.step_metrics()}
        abandoned = reader.rollouts(status="abandoned")
    assert [rid for rid, (s, step) in status.items() if s == "kept" and step == 2] == [20]  # only the redo
    assert {r["rollout_id"] for r in abandoned} == {21, 25, 103}
    assert {r["reason"] for r in abandoned} == {"the run was resumed from checkpoint step_1"}
    assert [status[rid][0] for rid in (0, 1, 5, 10, 11, 15, 101, 102)] == [
        "kept",
        "kept",
        "discarded",
        "kept",
        "kept",
        "discarded",
        "eval",
        "eval",
    ]
    assert sorted(metrics) == [0, 1, 2] and "loss" not in metrics[2]  # step 2 is trained again
    assert metrics[2]["eval/countdown/correct"] == 2.5  # evaluated on the checkpointed weights


FULL_DISK = """
import resource, signal, sys
from refractor.telemetry.store import RunStore, RunStoreError

store = RunStore(sys.argv[1])
store.log_step_metrics(0, {"loss": 1.5})
store.flush()
# the file may grow 64 KiB more, then every write fails as on a full disk (SIGXFSZ ignored: EFBIG)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (store.path.stat().st_size + 65536, resource.RLIM_INFINITY))
try:
    for i in range(10_000):
        store.log_system_metrics("node", {f"metric_{j}": float(j) for j in range(200)})
        store.flush()
except RunStoreError as err:
    print("write:", err)
try:
    store.close("finished")
except RunStoreError as err:
    print("close:", err)
"""


def test_a_failed_write_stops_the_run_store_with_one_clear_error_and_keeps_what_was_written(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["write", "close"], proc.stdout
    for line in lines:
        assert str(tmp_path / "run.db") in line and "--resume_from_checkpoint true" in line, line
    assert "Traceback" not in proc.stderr
    with RunReader(tmp_path) as reader:  # intact: what was committed before the failure is there
        assert [m["loss"] for m in reader.step_metrics(["loss"])] == [1.5]
        assert reader.meta()["status"] == "running"  # the next start reports it as crashed


VERSION_1_SYSTEM_METRICS = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1'), ('status', '"finished"');
CREATE TABLE system_metrics (time REAL NOT NULL, source TEXT NOT NULL, name TEXT NOT NULL, value REAL);
INSERT INTO system_metrics VALUES (1.0, 'driver', 'cpu_utilization_percent', 12.5);
"""


def test_a_version_1_store_is_read_as_is_and_migrated_when_written_again(tmp_path):
    import sqlite3

    conn = sqlite3.connect(tmp_path / "run.db")
    conn.executescript(VERSION_1_SYSTEM_METRICS)
    conn.close()
    with RunReader(tmp_path) as reader:  # read-only: nothing changes, nodes read as ''
        assert reader.system_metrics() == [
            {"time": 1.0, "source": "driver", "name": "cpu_utilization_percent", "value": 12.5, "node": ""}
        ]
        assert reader.system_metrics(node="10.0.0.1") == []
        assert reader.meta()["schema_version"] == 1
    store = RunStore(tmp_path)  # a resume writes to it: the new column is added, old rows kept
    store.log_system_metrics("system", {"cpu_utilization_percent": 40.0}, timestamp=2.0, node="10.0.0.1")
    store.close()
    with RunReader(tmp_path) as reader:
        assert [(r["node"], r["value"]) for r in reader.system_metrics()] == [("", 12.5), ("10.0.0.1", 40.0)]
        assert reader.system_metrics(node="10.0.0.1")[0]["source"] == "system"
        assert reader.meta()["schema_version"] == SCHEMA_VERSION
