"""Typed seams of the weight sync: update targets, settings from the run config, and rank 0's
``SyncReport`` -> the run store's ``weight_sync`` timeline event (names and attrs the metrics read)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from refractor.records import TimelineEvent
from refractor.weight_sync import PushResult, SendStats, SyncReport, UpdateTarget, WeightSyncSettings

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "examples" / "quickstart.yaml"


def push_result(target: UpdateTarget) -> PushResult:
    stats = SendStats(checksum=1, tensors=2, bytes=3, buckets=1, metadata_sent=True, seconds=0.25)
    return PushResult(
        version=4,
        target=target,
        trainer_seconds=1.5,
        paused_seconds=0.5,
        transfer_seconds=0.25,
        stats=stats,
        reports={},
    )


def test_update_targets_are_the_strings_servers_and_the_run_store_see():
    assert UpdateTarget("full") is UpdateTarget.FULL
    assert UpdateTarget("training_only") is UpdateTarget.TRAINING_ONLY
    assert UpdateTarget.TRAINING_ONLY == "training_only" and str(UpdateTarget.FULL) == "full"
    with pytest.raises(ValueError):
        UpdateTarget("eval_only")


def test_a_sync_report_becomes_the_weight_sync_timeline_event():
    report = SyncReport.of_push(100.0, 102.0, push_result(UpdateTarget.TRAINING_ONLY))
    (event,) = report.timeline_events(4, UpdateTarget.TRAINING_ONLY)
    assert event == TimelineEvent(
        "weight_sync",
        100.0,
        102.0,
        component="trainer",
        attrs={
            "version": 4,
            "target": "training_only",
            "push_seconds": 0.5,  # the servers' pause -> resume
            "transfer_seconds": 0.25,
            "trainer_seconds": 1.5,
            "paused_seconds": 0.5,
        },
    )
    assert type(event.attrs["target"]) is str  # the run store serializes a plain string


def test_the_trainer_group_reports_rank_zeros_sync(monkeypatch):
    from refractor.runtime import trainer_group

    report = SyncReport(
        start=1.0, end=2.0, push_seconds=0.1, transfer_seconds=0.05, trainer_seconds=0.9, paused_seconds=0.1
    )
    calls = []

    class Rank:
        def __init__(self, result):
            self.sync_weights = SimpleNamespace(remote=lambda version, target: calls.append(target) or result)

    async def await_ranks(refs, what, timeout_s):
        return list(refs)

    monkeypatch.setattr(trainer_group, "await_ranks", await_ranks)
    group = object.__new__(trainer_group.RayTrainerGroup)
    group.actors = [Rank(report), Rank(None)]
    group.call_timeout_s = 10.0
    (event,) = asyncio.run(group.update_weights(7, "training_only"))
    assert calls == [UpdateTarget.TRAINING_ONLY, UpdateTarget.TRAINING_ONLY]
    assert [event] == report.timeline_events(7, UpdateTarget.TRAINING_ONLY)
    assert (event.start, event.end, event.attrs["version"]) == (1.0, 2.0, 7)


def test_settings_come_from_the_run_config():
    from refractor.config import load_config

    cfg = load_config(
        QUICKSTART,
        {
            "weight_broadcast_mode": "per_tensor",
            "weight_broadcast_cpu_staging": True,
            "weight_sync_gather_before_pause_mb": 3,
            "weight_sync_inflight_kv": "keep",
            "ray_broadcast_init_timeout_s": 42,
        },
    )
    settings = WeightSyncSettings.from_config(cfg)
    assert settings == WeightSyncSettings(
        broadcast_mode="per_tensor",
        cpu_staging=True,
        init_timeout_s=42.0,
        timeout_s=42.0,
        gather_before_pause_bytes=3 * 2**20,
        inflight_kv="keep",
    )
    with pytest.raises(ValueError, match="inflight_kv must be 'recompute' or 'keep', got 'stale'"):
        WeightSyncSettings(inflight_kv="stale")


def test_the_weight_sync_package_imports_without_pydantic():
    code = (
        "import sys; sys.modules['pydantic'] = None\n"
        "import refractor.weight_sync, refractor.weight_sync.gather\n"
        "assert sys.modules['pydantic'] is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_settings_defaults_are_the_config_defaults():
    """One home per default: the dataclass's defaults equal the schema's for every key it reads."""
    from refractor.config import RefractorConfig

    cfg = RefractorConfig(model="some/model", environments=[{"name": "countdown"}])
    assert WeightSyncSettings.from_config(cfg) == WeightSyncSettings()
