"""The dashboard's read indexes (schema 4): answers are the same without them (a store written
before them is read as it is, only slower), and a run that writes to an older store again adds
them and keeps every row."""

from __future__ import annotations

import sqlite3

from refractor.telemetry import derived, rollout_stats, series
from refractor.telemetry.query import RunReader
from refractor.telemetry.store import SCHEMA_VERSION, RunStore
from refractor.telemetry.synthetic import SyntheticSpec, write_synthetic_run

DASHBOARD_INDEXES = (
    "step_metrics_by_name",
    "rollouts_dispatch",
    "rollouts_step_stats",
    "events_duration",
    "events_name",
)


def answers(run_dir):
    with RunReader(run_dir) as r:
        return (
            series.metric_names(r),
            rollout_stats.derived_step_metrics(r, ["math"]),
            derived.distribution_over_steps(r, "reward"),
            series.lanes_window(r, 1_750_000_010.0, 1_750_000_020.0, 10.0),
            series.events_window(r, 1_750_000_000.0, 1_750_000_030.0, 10.0, min_duration=0.5, wide=1.0),
        )


def test_answers_are_the_same_without_the_indexes_and_a_resume_adds_them(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "run", SyntheticSpec(steps=6, rollouts_per_step=16))
    with_indexes = answers(run_dir)
    conn = sqlite3.connect(run_dir / "run.db")  # make it a version-3 store
    for index in DASHBOARD_INDEXES:
        conn.execute(f"DROP INDEX {index}")
    conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with RunReader(run_dir) as r:
        assert not any(r.has_index(i) for i in DASHBOARD_INDEXES)
        rollouts = len(r.rollouts())
    assert answers(run_dir) == with_indexes
    RunStore(run_dir).close()  # a resume opens it for writing
    with RunReader(run_dir) as r:
        assert all(r.has_index(i) for i in DASHBOARD_INDEXES)
        assert r.meta()["schema_version"] == SCHEMA_VERSION
        assert len(r.rollouts()) == rollouts
    assert answers(run_dir) == with_indexes
