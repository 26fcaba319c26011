"""`refractor eval` end to end on CPU: Ray, native inference servers on a saved model, the training
eval runner, results in the run store. pass@k against a naive float formula; one row per checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from refractor.config import load_config
from refractor.evals.standalone import run_standalone_evals
from refractor.evals.standalone_config import load_eval_config
from refractor.telemetry.query import RunReader
from refractor.train import run_training
from refractor.ui import create_app

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_ENVS = Path(__file__).parent / "envs"
QUICKSTART = ROOT / "configs" / "examples" / "quickstart.yaml"
K = 4


@pytest.fixture(autouse=True)
def _env_paths(monkeypatch):
    monkeypatch.setenv("REFRACTOR_ENV_PATH", os.pathsep.join([str(ROOT / "environments"), str(FIXTURE_ENVS)]))


def naive_pass_at_k(n: int, c: int, k: int) -> float:
    """1 - P(k draws without replacement all wrong), as a float64 product (no binomials)."""
    if n - c < k:
        return 1.0
    p_all_wrong = 1.0
    for i in range(k):
        p_all_wrong *= (n - c - i) / (n - i)
    return 1.0 - p_all_wrong


def naive_pass_pow_k(n: int, c: int, k: int) -> float:
    p_all_right = 1.0
    for i in range(k):
        p_all_right *= max(c - i, 0) / (n - i)
    return p_all_right


def eval_overrides(tmp_path, num_samples: int) -> dict:
    return {
        "model": "refractor-testing/tiny-qwen2",
        "inference_engine": "native",
        "kv_cache_memory_gb": 0.25,
        "max_model_len": 256,
        "max_tokens": 4,
        "ray_address": "",
        "ray_inference_cpus_per_worker": 1,
        "run_dir": str(tmp_path / "runs"),
        "run_name": "ev",
        "evals": [
            {
                "name": "fixed_pass_rate",
                "num_samples": num_samples,
                "kwargs": {"completions_per_prompt": K},
                "pass_k": {"at_k": {"metrics": ["correct"], "k": [1, 2, K]}, "pow_k": {"k": [2]}},
            }
        ],
    }


@pytest.mark.slow
def test_pass_at_k_of_a_fixed_environment_is_the_unbiased_estimator_and_a_finished_eval_resumes_to_itself(
    tmp_path,
):
    keys, cfg = load_eval_config(None, eval_overrides(tmp_path, num_samples=5))
    run_dir, summaries = run_standalone_evals(keys, cfg, quiet=True)
    correct = [p % (K + 1) for p in range(5)]  # per prompt, out of K
    expected = {"correct": sum(correct) / (5 * K)}
    for k in (1, 2, K):
        expected[f"pass@{k}/correct"] = sum(naive_pass_at_k(K, c, k) for c in correct) / 5
    expected["pass^2/correct"] = sum(naive_pass_pow_k(K, c, 2) for c in correct) / 5
    with RunReader(run_dir) as reader:
        (m,) = reader.step_metrics()
        rows = reader.rollouts(status="eval")
        assert reader.meta()["status"] == "finished"
    assert m["step"] == 0 and m["eval/fixed_pass_rate/policy_version"] == 0
    for name, value in expected.items():
        assert m[f"eval/fixed_pass_rate/{name}"] == pytest.approx(value, abs=1e-12), name
    assert m["eval/fixed_pass_rate/num_prompts"] == 5 and m["eval/fixed_pass_rate/num_completions"] == 5 * K
    assert len(rows) == 5 * K and all(not r["reason"] and r["step"] == 0 for r in rows)
    assert [(s.step, s.name) for s in summaries] == [(0, "fixed_pass_rate")]

    # every prompt is stored: --resume runs nothing (no cluster, no server) and reports the same numbers
    run_dir, again = run_standalone_evals(keys, cfg, resume=True, quiet=True)
    first = {k: v for k, v in summaries[0].metrics.items() if k != "timing_total"}  # nothing ran this time
    assert again[0].metrics == pytest.approx(first)
    with RunReader(run_dir) as reader:
        assert len(reader.rollouts(status="eval")) == 5 * K


@pytest.mark.slow
def test_every_checkpoint_of_a_quickstart_run_gives_one_eval_row_per_step(tmp_path):
    runs = tmp_path / "runs"
    overrides = {"run_dir": str(runs), "run_name": "qs", "number_of_steps": 2, "checkpoint_every": 1}
    train_dir = run_training(load_config(QUICKSTART, {**overrides, "ray_address": ""}), quiet=True)
    config = tmp_path / "eval.yaml"
    config.write_text(
        f"checkpoint_dir: {train_dir}\n"
        "inference_engine: native\nkv_cache_memory_gb: 0.25\nmax_model_len: 256\nmax_tokens: 4\n"
        "ray_inference_cpus_per_worker: 1\nrun_name: sweep\n"
        "evals:\n  - name: repeat_letter\n    num_samples: 2\n    pass_k: {at_k: [1, 2]}\n"
    )
    keys, cfg = load_eval_config(config, ["--run_dir", str(runs), "--ray_address", ""])
    run_dir, summaries = run_standalone_evals(keys, cfg, quiet=True)
    # step_1 and step_2 hold versions 1 and 2: reported at steps 1 and 2, as training reports its evals
    assert [(s.step, s.name) for s in summaries] == [(1, "repeat_letter"), (2, "repeat_letter")]
    with RunReader(run_dir) as reader:
        steps = reader.step_metrics()
        rows = reader.rollouts(status="eval")
        assert reader.meta()["status"] == "finished"
    assert [m["step"] for m in steps] == [1, 2]  # one row per checkpoint
    for m in steps:
        assert m["eval/repeat_letter/policy_version"] == m["step"]
        assert 0.0 <= m["eval/repeat_letter/pass@2/letter_fraction"] <= 1.0
    assert sorted({r["step"] for r in rows}) == [1, 2] and len(rows) == 2 * 2 * 2
    assert all(r["start_version"] == r["step"] for r in rows)
    assert not list((run_dir / "converted").iterdir())  # the converted copies are deleted
    with TestClient(create_app([runs], tmp_path / "ui-state")) as client:  # the dashboard shows them
        assert client.get("/api/runs/sweep").json()["has"]["evals"]
        evals = client.get("/api/runs/sweep/evals").json()
    assert evals["evals"] == {"repeat_letter": [1, 2]}
    assert "eval/repeat_letter/pass@2/letter_fraction" in evals["metrics"]


def test_eval_py_runs_the_eval_command():
    out = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--resume" in out.stdout and "checkpoint" in out.stdout
