"""A stop signal leaves the driver all the time its cleanup needs, also once Ray is up.

Ray's C++ core installs a crash reporter for SIGTERM that arms ``alarm(3)`` and aborts the process
(exit 134) three seconds later: a cleanup slower than that (both cores busy) was cut short.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

DRIVER = textwrap.dedent(
    """
    import os, signal, sys, time
    from refractor.config import RefractorConfig
    from refractor.runtime import stop_signals
    from refractor.runtime.cluster import RayHost, RaySettings

    stop_signals.install()
    host = RayHost()
    cfg = RefractorConfig(environments=[{"name": "countdown"}], ray_address="")
    connection = host.connect(RaySettings.from_config(cfg, run_dir=sys.argv[1]))
    if sys.argv[2] == "pending-alarm":  # what Ray's reporter leaves when a signal hits it first
        signal.alarm(2)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    except KeyboardInterrupt:
        with stop_signals.deferred():
            time.sleep(5)  # a slow cleanup: longer than Ray's three seconds
            host.close(connection.started_local)
        print("cleaned up", stop_signals.signal_name(), flush=True)
        sys.exit(stop_signals.exit_code())
    """
)


@pytest.mark.parametrize("case", ["after-ray-init", "pending-alarm"])
def test_sigterm_after_ray_init_lets_a_slow_cleanup_finish(tmp_path, case):
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path), case],
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "cleaned up SIGTERM" in proc.stdout, output
    assert "SIGTERM received" not in output, output  # Ray's reporter never saw the signal
