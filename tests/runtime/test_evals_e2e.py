"""`refractor train` with evals, end to end on CPU: Ray, two native servers (the last one reserved
for evals), a trainer rank and the run store: a baseline eval at step 0, a step eval on the eval
server at step 2, a final eval at step 3, and separate_eval_samples keeping eval prompts out of training."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from refractor.config import load_config
from refractor.telemetry.query import RunReader
from refractor.train import run_training

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "examples" / "quickstart.yaml"
FIXTURE_EVALS = ROOT / "tests" / "evals" / "fixtures"


@pytest.mark.slow
def test_baseline_step_and_final_evals_land_in_the_run_store(tmp_path, monkeypatch):
    monkeypatch.setenv("REFRACTOR_ENV_PATH", str(ROOT / "environments"))
    monkeypatch.setenv("REFRACTOR_EVAL_PATH", str(FIXTURE_EVALS))
    cfg = load_config(
        QUICKSTART,
        {
            "run_dir": str(tmp_path / "runs"),
            "run_name": "evals",
            "ray_address": "",
            "number_of_steps": 3,
            "inference_num_workers": 2,
            "ray_inference_cpus_per_worker": 0.5,
            "eval_num_servers": 1,
            "eval_before_training": True,
            "eval_after_training": True,
            "max_concurrent_prompts_per_server": 2,
            "evals": [
                {
                    "name": "repeat_letter",
                    "eval_every": 2,
                    "num_samples": 4,
                    "separate_eval_samples": True,
                    "max_tokens": 6,
                    "pass_k": {"at_k": {"metrics": ["letter_fraction"], "k": [1, 2]}},
                },
                {"name": "letters", "eval_every": 2, "num_samples": 3, "temperature": 0.5},
            ],
        },
    )
    run_dir = run_training(cfg, quiet=True)
    with RunReader(run_dir) as reader:
        steps = {m["step"]: m for m in reader.step_metrics()}
        for step in (0, 2, 3):
            m = steps[step]
            assert m["eval/repeat_letter/policy_version"] == step and m["eval/letters/policy_version"] == step
            assert m["eval/repeat_letter/num_completions"] == 4 * 2 and m["eval/letters/num_completions"] == 3
            for name in (
                "eval/repeat_letter/letter_fraction",
                "eval/repeat_letter/pass@2/letter_fraction",
                "eval/letters/has_letter",
            ):
                assert 0.0 <= m[name] <= 1.0, (step, name)
        assert "eval/letters/has_letter" not in steps[1]
        rows = reader.rollouts(status="eval")
        assert {r["step"] for r in rows} == {0, 2, 3} and len(rows) == 3 * (8 + 3)
        assert {r["server"] for r in rows if r["step"] == 2} == {"server-1"}  # the eval server only
        assert {r["env"] for r in rows} == {"repeat_letter", "letters"}
        assert all(r["reward"] is None and r["start_version"] == r["step"] for r in rows)
        kept = reader.rollouts(status="kept")
        assert len(kept) == 3 * 4 * 16
        # drained at the step-2 eval: no training rollout on the eval server with the weights of version 2
        assert all(r["start_version"] < 2 for r in kept if r["server"] == "server-1")
        held_out = [f"(#{i})" for i in range(4)]  # the eval's prompts never reach training
        assert not [r for r in kept if any(h in r["prompt_text"] for h in held_out)]
        names = [e["name"] for e in reader.timeline() if e["name"].startswith("eval_")]
        assert names == [
            "eval_baseline_start",
            "eval_baseline_done",
            "eval_step_start",
            "eval_step_done",
            "eval_final_start",
            "eval_final_done",
        ]
        assert reader.meta()["status"] == "finished"
        assert reader.last_step() == 2  # the last training step (0-indexed), not the final eval's row at 3
    assert os.path.exists(Path(run_dir) / "logs" / "server-1.log")
