"""What a server process that exited is reported with: the error its log names, then its last lines."""

from __future__ import annotations

import sys

from refractor.inference.process import ServerProcess, log_errors

ENGINE_ERROR = (
    "RuntimeError: Worker failed with error 'CPU Generator does not use offset', please check the "
    "stack trace above for the root cause"
)
REQUEST_ERROR = (
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) "
    "for the root cause."
)


def _vllm(process: str, where: str, *lines: str, level: str = "ERROR") -> str:
    return "".join(f"({process} pid=12) {level} 11-27 04:35:17 [{where}] {line}\n" for line in lines)


# The shape of a vLLM 0.32 server's log when a worker's error kills its engine: the worker's
# traceback, the engine's fatal line and traceback, then one traceback per failed request and the
# shutdown, which fill the last lines.
VLLM_ENGINE_DEATH = (
    _vllm(
        "APIServer", "system_utils.py:255", "ulimit 20000: `OSError: [Errno 24]` may follow", level="WARNING"
    )
    + _vllm(
        "Worker",
        "multiproc_executor.py:1063",
        "WorkerProc hit an exception.",
        "Traceback (most recent call last):",
        '  File "gpu_model_runner.py", line 3502, in _bookkeeping_sync',
        "    gen.set_offset(gen.get_offset() - 4)",
        "RuntimeError: CPU Generator does not use offset",
    )
    + _vllm(
        "EngineCore",
        "core.py:1512",
        "EngineCore encountered a fatal error.",
        "Traceback (most recent call last):",
        '  File "multiproc_executor.py", line 444, in get_response',
        "    raise RuntimeError(",
        ENGINE_ERROR,
    )
    + 3
    * _vllm(
        "APIServer",
        "vllm_error.py:54",
        "Traceback (most recent call last):",
        '  File "serving.py", line 384, in serve_tokens',
        REQUEST_ERROR,
    )
    + 50 * _vllm("APIServer", "core_client.py:772", "[shutdown] MPClient: stopping", level="INFO")
)


def test_the_error_that_killed_vllms_engine_is_found_under_the_failed_requests():
    engine_error, last_error = log_errors(VLLM_ENGINE_DEATH.splitlines(keepends=True))
    assert engine_error == ENGINE_ERROR
    assert last_error == REQUEST_ERROR
    plain = [
        "starting\n",
        "Traceback (most recent call last):\n",
        "  File 'x.py'\n",
        "    raise ValueError('a')\n",
    ]
    assert log_errors([*plain, "ValueError: a\n", "shutting down\n"]) == (None, "ValueError: a")
    assert log_errors(["INFO ready\n", "RuntimeError: not after a traceback\n"]) == (None, None)


def _exited_server(tmp_path, script: str) -> ServerProcess:
    server = ServerProcess.spawn(
        [sys.executable, "-c", script], url="http://127.0.0.1:1", log_path=tmp_path / "s.log", what="server"
    )
    server.process.wait(60)
    return server


def test_a_server_that_exited_is_reported_with_the_error_its_log_names_then_its_last_lines(tmp_path):
    log = tmp_path / "vllm-death.txt"
    log.write_text(VLLM_ENGINE_DEATH)
    vllm = _exited_server(tmp_path / "vllm", f"print(open({str(log)!r}).read(), end='')")
    report = vllm.exit_report(lines=5)
    head, rest = report.split("\n", 1)
    assert head == f"Its engine died of: {ENGINE_ERROR}"
    assert rest.startswith(f"Its last log lines ({vllm.log_path}):\n")
    assert rest.count("[shutdown] MPClient: stopping") == 5

    crashed = _exited_server(tmp_path / "plain", "raise ValueError('no weights in /m')")
    report = crashed.exit_report()
    assert report.startswith("The last error in its log: ValueError: no weights in /m\nIts last log lines (")

    quiet = _exited_server(tmp_path / "quiet", "print('bye')")
    assert quiet.exit_report() == f"Its last log lines ({quiet.log_path}):\nbye\n"
