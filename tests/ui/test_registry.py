"""The registry's caches: a live run's recomputed per-step metrics re-read only its newest steps
and still equal a full recomputation; running maxima fold in only new rows."""

from __future__ import annotations

from refractor.records import Rollout, RolloutStatus
from refractor.records.rollout import Turn
from refractor.telemetry import rollout_stats, series
from refractor.telemetry.query import RunReader
from refractor.telemetry.store import RunStore
from refractor.telemetry.synthetic import SyntheticSpec, write_synthetic_run
from refractor.ui.registry import RunRegistry


def kept(rid: int, group: int, reward: float, tokens: int) -> Rollout:
    turn = Turn(0, prompt_ids=[1, 2], completion_ids=[3] * tokens, logprobs=[0.0] * tokens, end_time=9e9)
    r = Rollout(rid, group, sample_idx=rid % 2, env_name="math", turns=[turn], reward=reward)
    r.dispatch_time, r.finish_time = 9e9 - 1, 9e9
    r.mark(RolloutStatus.KEPT)
    return r


def test_live_run_recomputed_metrics_match_a_full_read(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "runs" / "live", SyntheticSpec(steps=20, rollouts_per_step=16))
    registry = RunRegistry([tmp_path / "runs"])
    (entry,) = registry.entries()
    reads = []

    def compute(since):
        reads.append(since)
        with RunReader(run_dir) as r:
            return rollout_stats.derived_step_metrics(r, None, since)

    first = registry.cached_steps(entry, "d", compute)
    assert reads == [None] and sorted(first) == list(range(20))
    assert registry.cached_steps(entry, "d", compute) == first and reads == [None]  # nothing changed
    store = RunStore(run_dir)  # the run writes on: more rows of step 10 (async: an older step), step 20
    store.log_rollouts([kept(900_000, 77_000, 1.0, 5), kept(900_001, 77_000, 0.0, 9)], 10, 10)
    store.log_rollouts([kept(900_002, 88_000, 1.0, 4), kept(900_003, 88_000, 0.5, 7)], 20, 20)
    store.flush()
    again = registry.cached_steps(entry, "d", compute)
    assert reads == [None, 3]  # only the newest 16 steps seen (4..19) and later ones were read
    with RunReader(run_dir) as r:
        assert again == rollout_stats.derived_step_metrics(r)
    store.close()


def test_running_max_reads_only_new_rows(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "runs" / "r", SyntheticSpec(steps=3, rollouts_per_step=8))
    registry = RunRegistry([tmp_path / "runs"])
    (entry,) = registry.entries()
    seen = []

    def read(after):
        seen.append(after)
        with RunReader(run_dir) as r:
            return series.max_after(r, "rollouts", "finish_time", "rollout_id", after)

    before = registry.running_max(entry, "end", read)
    store = RunStore(run_dir)
    store.log_rollouts([kept(900_000, 1, 1.0, 3)], 3, 3)
    store.close()
    after = registry.running_max(entry, "end", read)
    assert seen[0] == 0 and seen[1] > 0 and after == 9e9 > before
