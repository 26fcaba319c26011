"""The metrics of one training step, from hand-made rollouts, trainer metrics, timing and events."""

import pytest

from refractor.records import TimelineEvent
from refractor.telemetry.metrics import RolloutSummary, rollout_step_metrics
from refractor.telemetry.step_metrics import StepTiming, step_metrics

ROWS = [
    RolloutSummary(0, "kept", reward=1.0, advantage=0.5, prompt_tokens=4, completion_tokens=10),
    RolloutSummary(0, "kept", reward=0.0, advantage=-0.5, prompt_tokens=4, completion_tokens=30),
    RolloutSummary(1, "discarded", "max_async", prompt_tokens=4, completion_tokens=7),
]
TIMING = StepTiming(waiting_for_data=1.0, train_step=2.0, weight_sync=0.5, step_total=4.0)


def test_timing_throughput_versions_and_trainer_metrics():
    m = step_metrics(
        ROWS, {"grad_norm": 3}, TIMING, completion_tokens=40, async_level=1, version=5, events=[]
    )
    assert m["timing_waiting_for_data"] == 1.0 and m["timing_train_step"] == 2.0
    assert m["timing_weight_sync_total"] == 0.5 and m["timing_step_total"] == 4.0
    assert m["tokens_per_second"] == pytest.approx(10.0)
    assert m["async_level"] == 1.0 and m["policy_version"] == 5.0
    assert m["grad_norm"] == 3.0 and isinstance(m["grad_norm"], float)
    for name, value in rollout_step_metrics(ROWS).items():
        assert m[name] == value, name
    assert "timing_weight_sync_trainer_total" not in m


def test_weight_sync_event_gives_the_trainer_and_inference_sides():
    events = [
        TimelineEvent("train_step", 0.0, 1.0, "trainer", {"trainer_seconds": 9.0}),
        TimelineEvent("weight_sync", 1.0, 2.0, "trainer", {"trainer_seconds": 0.25, "paused_seconds": 0.75}),
    ]
    m = step_metrics(ROWS, {}, TIMING, completion_tokens=40, async_level=0, version=1, events=events)
    assert m["timing_weight_sync_trainer_total"] == 0.25
    assert m["timing_weight_sync_inference_total"] == 0.75


def test_no_elapsed_time_gives_zero_throughput():
    timing = StepTiming(0.0, 0.0, 0.0, step_total=0.0)
    m = step_metrics(ROWS, {}, timing, completion_tokens=40, async_level=0, version=1, events=[])
    assert m["tokens_per_second"] == 0.0
