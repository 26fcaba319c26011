"""One writer per run directory, and start-up checks that refuse a run without touching the old one:
a second writer (also with --overwrite) is refused naming the holder, a lock left by a killed
process does not block, a resume without a checkpoint says so in one line, and a run store left
`running` by a dead writer is marked `crashed`."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys

import pytest

from refractor.config import RefractorConfig
from refractor.errors import RunSetupError
from refractor.runtime.run_lock import RunLock, RunLockedError
from refractor.telemetry.store import RunStore
from refractor.train import prepare_run

HOLD = (
    "import sys, time\n"
    "from refractor.runtime.run_lock import RunLock\n"
    "RunLock.acquire(sys.argv[1])\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture
def holder(tmp_path):
    """A separate process that holds the lock of ``tmp_path/run`` until it is killed."""
    root = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield root, proc
    proc.kill()
    proc.wait()


def config(tmp_path, **overrides) -> RefractorConfig:
    base = dict(
        model="refractor-testing/tiny-qwen2",
        environments=[{"name": "countdown"}],
        run_dir=str(tmp_path),
        run_name="run",
    )
    return RefractorConfig(**{**base, **overrides})


def finished_run(root) -> None:
    store = RunStore(root, run_name="run")
    store.log_step_metrics(0, {"loss": 1.0})
    store.close("finished")


def status(root) -> str:
    conn = sqlite3.connect(root / "run.db")
    try:
        return json.loads(conn.execute("SELECT value FROM meta WHERE key = 'status'").fetchone()[0])
    finally:
        conn.close()


def test_a_second_writer_is_refused_naming_the_holder(holder):
    root, proc = holder
    with pytest.raises(RunLockedError) as err:
        RunLock.acquire(root)
    assert f"{root} is in use by another run (pid {proc.pid} on host" in str(err.value)


def test_the_lock_of_a_killed_process_does_not_block(holder):
    root, proc = holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    lock = RunLock.acquire(root)  # kill -9 released it: nothing stale to clean up
    with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
        RunLock.acquire(root)  # held again, by this process now
    lock.release()
    RunLock.acquire(root).release()


def test_overwrite_of_a_running_run_is_refused_and_deletes_nothing(holder, tmp_path):
    root, _ = holder
    finished_run(root)
    before = sorted(p.name for p in root.iterdir())
    with pytest.raises(RunSetupError, match="is in use by another run"):
        prepare_run(config(tmp_path), overwrite=True)
    assert sorted(p.name for p in root.iterdir()) == before and status(root) == "finished"


def test_overwrite_replaces_a_run_nobody_writes(tmp_path):
    root = tmp_path / "run"
    finished_run(root)
    (root / "checkpoints").mkdir()
    cfg, paths, lock = prepare_run(config(tmp_path), overwrite=True)
    try:
        assert paths.root == root and sorted(p.name for p in root.iterdir()) == [".lock", "logs"]
        assert cfg.run_name == "run"
    finally:
        lock.release()


def test_resume_without_a_checkpoint_is_one_line_and_leaves_the_run(tmp_path):
    root = tmp_path / "run"
    finished_run(root)
    with pytest.raises(RunSetupError) as err:
        prepare_run(config(tmp_path, resume_from_checkpoint=True))
    message = str(err.value)
    assert message.startswith(f"cannot resume {root}: resume_from_checkpoint: no complete checkpoint")
    assert message.endswith("the run is left as it was") and "\n" not in message
    assert status(root) == "finished"
    RunLock.acquire(root).release()  # the refused start released the lock


def test_a_run_left_running_by_a_dead_writer_is_marked_crashed(tmp_path):
    root = tmp_path / "run"
    store = RunStore(root, run_name="run")
    store.flush()
    assert status(root) == "running"
    store._queue.put(None)  # the writer stops without closing the run, as a killed process would
    store._thread.join()
    with pytest.raises(RunSetupError, match="already holds a run"):
        prepare_run(config(tmp_path))  # still refused without --overwrite or resume ...
    assert status(root) == "running"  # ... and untouched
    with pytest.raises(RunSetupError, match="cannot resume"):
        prepare_run(config(tmp_path, resume_from_checkpoint=True))
    assert status(root) == "crashed"  # the lock was free, so the writer was gone
