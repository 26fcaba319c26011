"""`refractor ui`: its options reach the server, it binds 127.0.0.1 unless told otherwise, and
binding every interface prints a warning."""

from __future__ import annotations

from typer.testing import CliRunner

from refractor.cli import app


def run_ui(monkeypatch, tmp_path, *args):
    calls = {}

    def fake_run(application, host, port, log_level):
        calls.update(app=application, host=host, port=port)

    monkeypatch.setattr("uvicorn.run", fake_run)
    result = CliRunner().invoke(app, ["ui", "--no-open", "--state-dir", str(tmp_path / "state"), *args])
    return result, calls


def test_defaults_bind_localhost_on_8005(monkeypatch, tmp_path):
    (tmp_path / "runs").mkdir()
    result, calls = run_ui(monkeypatch, tmp_path, "--runs-dir", str(tmp_path / "runs"))
    assert result.exit_code == 0, result.output
    assert (calls["host"], calls["port"]) == ("127.0.0.1", 8005)
    assert "warning" not in result.output


def test_binding_every_interface_warns(monkeypatch, tmp_path):
    result, calls = run_ui(
        monkeypatch, tmp_path, "--host", "0.0.0.0", "--port", "9100", "--runs-dir", str(tmp_path)
    )
    assert result.exit_code == 0, result.output
    assert calls["host"] == "0.0.0.0" and calls["port"] == 9100
    assert "warning" in result.output and "0.0.0.0" in result.output


def test_a_missing_runs_dir_is_reported_not_fatal(monkeypatch, tmp_path):
    result, calls = run_ui(monkeypatch, tmp_path, "--runs-dir", str(tmp_path / "nope"))
    assert result.exit_code == 0 and "no folder" in result.output and calls
