"""Console progress (rich and quiet) and the optional W&B sink (offline mode)."""

import io
import json
import sys
import time
import zipfile

import pytest
from rich.console import Console

from refractor.records import Rollout
from refractor.telemetry.code_snapshot import CodeLimits, take_code_snapshot
from refractor.telemetry.console import ConsoleSink


class Ticks:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


METRICS = {"reward_sum_mean": 0.625, "kl_divergence_inference": 0.0123, "tokens_per_second": 4321.0}


def test_rich_progress_renders_numbers():
    out = io.StringIO()
    sink = ConsoleSink(10, console=Console(file=out, force_terminal=True, width=160, color_system=None))
    sink.log_step(2, METRICS)
    sink.close()
    text = out.getvalue()
    assert "3/10" in text and "0.625" in text and "0.0123" in text and "4321" in text and "ETA" in text


def test_quiet_mode_prints_plain_lines_with_eta():
    out = io.StringIO()
    clock = Ticks()
    sink = ConsoleSink(4, quiet=True, stream=out, clock=clock)
    clock.t = 10.0
    sink.log_step(0, METRICS)
    clock.t = 20.0
    sink.log_step(1, {"reward_sum_mean": 1.0})
    sink.close()
    assert out.getvalue().splitlines() == [
        "step 1/4 reward=0.625 train_infer_kl=0.0123 tokens/s=4321 eta=0:00:30",  # 10 s/step, 3 steps left
        "step 2/4 reward=1.000 train_infer_kl=- tokens/s=- eta=0:00:20",
    ]


def test_wandb_missing_gives_a_clear_error(monkeypatch):
    from refractor.telemetry import wandb_sink

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(RuntimeError, match=r"use_wandb: true.*pip install 'refractor\[wandb\]'"):
        wandb_sink.WandbSink("p", "r", ["t"])


def test_wandb_offline_logs_metrics_rollout_table_and_log_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from refractor.telemetry.wandb_sink import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.setenv("WANDB_TAGS", "a, b")
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "trainer-0.log").write_text("a trainer line\n")
    sink = WandbSink("proj", "my-run", ["ignored"], {"learning_rate": 1e-6}, run_dir=tmp_path, log_dir=logs)
    run = sink.run
    assert (run.project, run.name, list(run.tags)) == ("proj", "my-run", ["a", "b"])
    r = Rollout(7, 3, 0, "toy", prompt_text="q", reward=1.0, advantage=0.5)
    sink.log_step(0, METRICS, [r])
    assert run.config["learning_rate"] == 1e-6
    code = tmp_path / "project"
    (code / "envs").mkdir(parents=True)
    (code / "envs" / "my_env.py").write_text("REWARD = 1\n")
    snapshot = take_code_snapshot(code, {}, CodeLimits(2**20))
    sink.upload_code(snapshot)
    sink.close()
    # offline runs keep history in the binary run log and tables as JSON next to it
    [log] = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    # wandb's service process may still be flushing the binary log when finish() returns
    deadline = time.monotonic() + 30
    while b"kl_divergence_inference" not in log.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    history = log.read_bytes()
    assert (
        b"rollout/reward_mean" in history and b"kl_divergence_inference" in history and b"0.0123" in history
    )
    # the component log files, as run files under logs/ (docs/run-store.md#logs)
    [uploaded] = tmp_path.glob("wandb/offline-run-*/files/logs/trainer-0.log")
    assert uploaded.read_text() == "a trainer line\n"
    # the code snapshot, as code/source.zip + code/metadata.json
    [archive] = tmp_path.glob("wandb/offline-run-*/files/code/source.zip")
    with zipfile.ZipFile(archive) as zf:
        assert zf.read("project/envs/my_env.py") == b"REWARD = 1\n"
    [metadata] = tmp_path.glob("wandb/offline-run-*/files/code/metadata.json")
    assert json.loads(metadata.read_text())["file_count"] == 1
    [table] = tmp_path.glob("wandb/offline-run-*/files/media/table/rollouts_0_*.table.json")
    data = json.loads(table.read_text())
    assert data["columns"][:3] == ["step", "group_id", "rollout_id"] and data["data"][0][:3] == [0, 3, 7]


def test_every_sink_implements_the_step_sink_protocol():
    from refractor.orchestrator.protocols import StepSink
    from refractor.telemetry.wandb_sink import WandbSink

    methods = [name for name in vars(StepSink) if not name.startswith("_")]
    assert sorted(methods) == ["close", "log_eval", "log_step", "warn"]
    for sink in (ConsoleSink, WandbSink):
        assert all(callable(getattr(sink, name, None)) for name in methods), sink
