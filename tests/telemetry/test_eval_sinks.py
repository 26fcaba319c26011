"""Eval metrics in the console (a line per eval) and in W&B (offline; their own ``eval/step`` axis, so
a step eval that finishes after later training steps is not dropped)."""

from __future__ import annotations

import io
import time

import pytest

from refractor.telemetry.console import ConsoleSink

METRICS = {
    "eval/math500/correct": 0.5,
    "eval/math500/pass@4/correct": 0.75,
    "eval/math500/num_prompts": 8.0,
    "eval/math500/timing_total": 3.0,
    "eval/math500/policy_version": 2.0,
    "eval/gpqa/correct": 0.25,
}


def test_console_prints_one_line_per_eval():
    stream = io.StringIO()
    sink = ConsoleSink(10, quiet=True, stream=stream)
    sink.log_eval(2, METRICS)
    lines = stream.getvalue().splitlines()
    assert lines == [
        "eval math500 @ step 2: correct=0.500 pass@4/correct=0.750",
        "eval gpqa @ step 2: correct=0.250",
    ]


def test_wandb_logs_late_evals_on_their_own_axis(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from refractor.telemetry.wandb_sink import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink("proj", "evals", [], run_dir=tmp_path)
    for step in range(3):
        sink.log_step(step, {"loss": float(step)})
    sink.log_eval(1, {"eval/quiz/correct": 0.3125})  # a step eval finishing after step 2 was logged
    sink.log_step(3, {"loss": 3.0})
    sink.log_eval(4, {"eval/quiz/correct": 0.6875})  # the final eval, after the last step
    sink.close()
    [log] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 30
    while b"0.6875" not in log.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    history = log.read_bytes()
    assert b"0.3125" in history and b"0.6875" in history and b"eval/step" in history
