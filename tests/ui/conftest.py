"""Run stores for the dashboard's tests: synthetic runs made through the real schema (small), plus
the stores a user can break: a damaged file, a half-written one, an older schema."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from refractor.telemetry.synthetic import SyntheticSpec, write_synthetic_run

# a version-1 run store: no node column, no code tables, no dashboard indexes
VERSION_1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1'), ('status', '"finished"'), ('run_name', '"old"'),
    ('created_at', '1600000000.0'), ('config', '{"model": "old/model", "learning_rate": 0.001}');
CREATE TABLE step_metrics (step INTEGER NOT NULL, name TEXT NOT NULL, value REAL, time REAL NOT NULL,
    PRIMARY KEY (step, name));
INSERT INTO step_metrics VALUES (0, 'reward_sum_mean', 0.25, 1600000001.0),
    (1, 'reward_sum_mean', 0.5, 1600000002.0);
CREATE TABLE system_metrics (time REAL NOT NULL, source TEXT NOT NULL, name TEXT NOT NULL, value REAL);
INSERT INTO system_metrics VALUES (1600000001.0, 'system', 'cpu_utilization_percent', 12.5);
"""


def make_runs_dir(root: Path) -> Path:
    runs = root / "runs"
    write_synthetic_run(runs / "syn", SyntheticSpec(steps=20, rollouts_per_step=32, seed=1))
    write_synthetic_run(
        runs / "other",
        SyntheticSpec(steps=10, rollouts_per_step=16, seed=2, start_time=1_760_000_000.0, status="running"),
    )
    (runs / "broken").mkdir(parents=True)
    (runs / "broken" / "run.db").write_bytes(b"this is not a database, just some bytes" * 100)
    (runs / "half").mkdir()
    conn = sqlite3.connect(runs / "half" / "run.db")
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.commit()
    conn.close()
    (runs / "old").mkdir()
    conn = sqlite3.connect(runs / "old" / "run.db")
    conn.executescript(VERSION_1)
    conn.close()
    return runs


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory) -> Path:
    return make_runs_dir(tmp_path_factory.mktemp("ui"))
