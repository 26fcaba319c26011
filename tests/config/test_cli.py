"""The `refractor` command line: help, version, config show/check, clean errors (no tracebacks)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from refractor import __version__
from refractor.cli import app
from refractor.config import ConfigError
from refractor.errors import RunSetupError
from refractor.inference.process import ServerStartError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "configs" / "examples").glob("*.yaml"))
runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def test_help_lists_subcommands():
    res = run("--help")
    assert res.exit_code == 0
    assert "config" in res.output


def test_version():
    res = run("--version")
    assert res.exit_code == 0 and res.output.strip() == f"refractor {__version__}"


def test_examples_exist():
    names = {p.stem for p in EXAMPLES}
    assert {
        "countdown",
        "hendrycks_math",
        "hendrycks_math_with_eval",
        "wordle",
        "code",
        "quickstart",
        "dapo_math",
        "deepscaler",
        "i3_code",
    } <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_shows_and_checks(path):
    res = run("config", "show", "--config", str(path))
    assert res.exit_code == 0, res.output
    shown = yaml.safe_load(res.stdout)
    source = yaml.safe_load(path.read_text())
    for key in ("model", "environments"):
        assert shown[key] == source[key] or key == "environments"
    assert [e["name"] for e in shown["environments"]] == [e["name"] for e in source["environments"]]
    assert run("config", "check", str(path)).exit_code == 0


def test_show_applies_overrides(tmp_path):
    res = run(
        "config",
        "show",
        "--config",
        str(ROOT / "configs/examples/countdown.yaml"),
        "--learning_rate",
        "5e-7",
        "--group-size=4",
        "--debug",
    )
    assert res.exit_code == 0, res.output
    shown = yaml.safe_load(res.stdout)
    assert shown["learning_rate"] == 5e-7 and shown["group_size"] == 4 and shown["debug"] is True


def test_check_reports_errors_and_exits_nonzero(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("environments: [{name: countdown}]\nlearnig_rate: 1\nalgorithm: reinforce_pp\n")
    res = run("config", "check", str(bad))
    assert res.exit_code == 2
    assert "did you mean `learning_rate`" in res.output
    assert "Traceback" not in res.output


def test_check_names_unknown_environments_and_evals_listing_the_known_ones(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("environments: [{name: countdown}, {name: wordel}]\nevals: [{name: math5000}]\n")
    res = run("config", "check", str(bad))
    assert res.exit_code == 2 and "Traceback" not in res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert lines[0] == "error: invalid configuration"
    assert lines[1].startswith(
        "config: `environments[1].name` = 'wordel': unknown environment (did you mean 'wordle'?); known: "
    )
    assert "countdown, " in lines[1] and "hendrycks_math" in lines[1]
    assert lines[2].startswith(
        "config: `evals[0].name` = 'math5000': no eval or environment of that name (did you mean 'math500'?)"
    )
    assert "known evals: aime_2024, aime_2025, gpqa_diamond, math500; environments: " in lines[2]
    assert len(lines) == 3


def test_check_accepts_an_environment_used_as_an_eval(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("environments: [{name: countdown}]\nevals: [{name: countdown}, {name: math500}]\n")
    res = run("config", "check", str(good))
    assert res.exit_code == 0, res.output


def test_cross_field_error_from_console_script(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("environments: [{name: countdown}]\nalgorithm: reinforce_pp\n")
    proc = subprocess.run(
        [sys.executable, "-m", "refractor.cli", "config", "check", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "requires `advantage_norm: batch`" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def _unprivileged() -> list[str]:
    """Permission bits bind root only without CAP_DAC_OVERRIDE: the child runs without it."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root ignores permission bits and setpriv is not installed to drop that right")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


@pytest.mark.parametrize("existing_run", [False, True])
def test_a_read_only_run_directory_is_one_line_naming_it(tmp_path, existing_run):
    runs = tmp_path / "runs"
    (runs / "run").mkdir(parents=True)
    (runs / "run" / "run.db").write_bytes(b"")
    read_only = runs / "run" if existing_run else runs
    if not existing_run:
        shutil.rmtree(runs / "run")
    config = tmp_path / "c.yaml"
    config.write_text(
        f"model: refractor-testing/tiny-qwen2\nenvironments: [{{name: countdown}}]\n"
        f"run_dir: {runs}\nrun_name: run\nuse_wandb: false\n"
    )
    read_only.chmod(0o555)
    try:
        proc = subprocess.run(
            [*_unprivileged(), sys.executable, "-m", "refractor.cli", "train", "--config", str(config)]
            + (["--overwrite"] if existing_run else []),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        read_only.chmod(0o755)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
    assert line == (
        f"error: cannot write to {runs / 'run'}: Permission denied; make it writable or pick another "
        "`--run_dir`"
    )


def _no_signal_handler(monkeypatch):
    import signal

    monkeypatch.setattr(signal, "signal", lambda *args: None)  # `train` routes SIGTERM to Ctrl-C


@pytest.mark.parametrize(
    "error",
    [
        RunSetupError("/runs/a already holds a run. Pick another `--run_name`."),
        ServerStartError("native server for m exited during start-up"),
        ConfigError("`learning_rate` must be > 0"),
    ],
)
def test_train_prints_a_user_error_as_one_line_without_a_traceback(monkeypatch, error):
    _no_signal_handler(monkeypatch)

    def failing_run(cfg, *, quiet, overwrite, config_path):
        raise error

    monkeypatch.setattr("refractor.train.run_training", failing_run)
    res = run("train", "--environments", '[{"name": "countdown"}]')
    assert res.exit_code == 1
    assert f"error: {error}" in res.output
    assert "Traceback" not in res.output


def test_train_lets_an_unexpected_error_through_with_its_traceback(monkeypatch):
    _no_signal_handler(monkeypatch)

    def failing_run(cfg, *, quiet, overwrite, config_path):
        raise RuntimeError("a bug, not a user mistake")

    monkeypatch.setattr("refractor.train.run_training", failing_run)
    res = run("train", "--environments", '[{"name": "countdown"}]')
    assert isinstance(res.exception, RuntimeError) and "a bug" in str(res.exception)


def test_runs_lists_status_steps_and_last_reward_and_shows_a_dead_running_run_as_crashed(tmp_path):
    from refractor.runtime.run_lock import RunLock
    from refractor.telemetry.store import RunStore

    def make(name: str, rewards: list[float], status: str):
        store = RunStore(tmp_path / name, run_name=name)
        for step, reward in enumerate(rewards):
            store.log_step_metrics(step, {"reward_sum_mean": reward})
        store.close(status)

    make("done", [0.25, 0.5, 0.875], "finished")
    make("dead", [0.125], "running")  # what a killed driver leaves behind
    make("live", [], "running")
    lock = RunLock.acquire(tmp_path / "live")  # a driver that is still running
    try:
        result = runner.invoke(app, ["runs", str(tmp_path)])
    finally:
        lock.release()
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split()[1:4] for line in result.output.splitlines()[1:]}
    assert rows["done"] == ["finished", "3", "0.875"]
    assert rows["dead"] == ["crashed", "1", "0.125"]
    assert rows["live"][:2] == ["running", "0"]
    missing = runner.invoke(app, ["runs", str(tmp_path / "nope")])
    assert missing.exit_code == 1 and "no folder" in missing.output
