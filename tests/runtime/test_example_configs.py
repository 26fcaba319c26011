"""Every example config that mirrors one of Telescope's (configs/examples/) trains one real step on CPU:
the file as shipped, with only the sizes shrunk (a tiny random model of the same family, one server
and one trainer rank, two prompts of two samples, short completions) and the downloaded datasets
swapped for the offline fixtures that ship with the built-in environments. The runs share one Ray
session (a run that finds Ray connected uses it and leaves it up), so each costs only its servers and
trainer rank.

The random model writes no program, so ``i3_code`` (local bubblewrap sandbox) scores its samples
without running a test; tests/envs/test_code_env.py runs programs in that sandbox.

Not run here: ``code`` (the environment and sandbox of ``i3_code`` under refractor's own name),
``quickstart`` (tests/runtime/test_train_e2e.py runs it), ``countdown_from_scratch``
(its model is the checkpoint bench/sft_base.py writes; tests/runtime/test_rl_from_scratch.py trains
one and runs this config on it) and ``gpu_quickstart`` (a GPU config: random weights in Qwen2.5-0.5B's
shape, the quick start's countdown otherwise).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from refractor.config import load_config
from refractor.envs.data import fixture_path
from refractor.telemetry.query import RunReader
from refractor.train import run_training

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "configs" / "examples"
TELESCOPE_EXAMPLES = [
    "countdown",
    "hendrycks_math",
    "hendrycks_math_with_eval",
    "dapo_math",
    "deepscaler",
    "wordle",
    "i3_code",
]
# The environments whose datasets are downloaded, and the shipped fixture with the same columns.
OFFLINE_FIXTURES = {
    "countdown": "countdown",
    "hendrycks_math": "hendrycks_math",
    "dapo_math": "dapo_math",
    "deepscaler": "deepscaler",
    "i3_code": "code",
}
# What each environment's reward function records per sample (Telescope's metric names).
REWARD_METRICS = {
    "countdown": {"_format_reward", "_equation_reward"},
    "hendrycks_math": {"correct"},
    "dapo_math": {"correct"},
    "deepscaler": {"correct"},
    "wordle": {"_reward_correct", "_reward_partial", "_reward_length", "format_reward"},
    "i3_code": {"passed", "pass_rate", "sandbox_error"},
}
# MATH-500's columns (problem, answer, level, subject): the eval's offline stand-in.
MATH500_ROWS = [
    {"problem": "Compute $1+1$.", "answer": "2", "level": 1, "subject": "Prealgebra"},
    {"problem": "Simplify $\\frac{6}{4}$.", "answer": "\\frac{3}{2}", "level": 3, "subject": "Algebra"},
]
CLUSTER_CPUS = 4
SHRUNK = {
    "inference_engine": "native",
    "inference_num_workers": 1,
    "trainer_num_workers": 1,
    "ray_inference_cpus_per_worker": 0.5,
    "ray_trainer_cpus_per_worker": 1,
    "kv_cache_memory_gb": 0.25,
    "model_dtype": "float32",
    "mixed_precision_dtype": None,
    "number_of_steps": 1,
    "prompts_batch_size_for_trainer": 2,
    "group_size": 2,
    "max_concurrent_prompts_per_server": 4,
    # a random model scores the same on every sample: keep its zero-advantage groups so a batch fills
    "discard_group_zero_advantage": False,
    "max_tokens": 8,
    "max_model_len": 2048,
    "seq_len": 4096,
    "pad_to_multiple_of": 16,
    "checkpoint_every": False,
    "eval_after_training": False,
    "ray_address": "",
    "record_telemetry": False,  # step metrics and rollouts stay: what this test reads
}


def tiny_model(model: str) -> str:
    return "refractor-testing/tiny-qwen3" if "Qwen3" in model else "refractor-testing/tiny-qwen2"


def offline(entries: list[dict[str, Any]], datasets: dict[str, str]) -> list[dict[str, Any]]:
    """The config's environment or eval entries, each reading its data from ``datasets``."""
    out = []
    for entry in entries:
        kwargs = dict(entry.get("kwargs") or {})
        if entry["name"] in datasets:
            kwargs["dataset_name"] = datasets[entry["name"]]
        if "pool_size" in kwargs:
            kwargs["pool_size"] = 1  # one sandbox for two prompts of two samples
        out.append({**entry, "kwargs": kwargs})
    return out


def shrunk_evals(evals: list[dict[str, Any]], datasets: dict[str, str]) -> list[dict[str, Any]]:
    return [{**e, "num_samples": 2} for e in offline(evals, datasets)]


@pytest.fixture(scope="module")
def shared_ray():
    ray.shutdown()  # a session left by an earlier module would refuse ray.init
    ray.init(num_cpus=CLUSTER_CPUS, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def free_cpus(wait_s: float = 10.0) -> float:
    """The cluster's unreserved CPUs, once they are all back (Ray reports a release a moment late)."""
    deadline = time.monotonic() + wait_s
    while (free := ray.available_resources().get("CPU", 0.0)) < CLUSTER_CPUS and time.monotonic() < deadline:
        time.sleep(0.2)
    return free


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, str]:
    math500 = tmp_path_factory.mktemp("evals") / "math500.jsonl"
    math500.write_text("".join(json.dumps(row) + "\n" for row in MATH500_ROWS))
    return {
        **{env: str(fixture_path(name)) for env, name in OFFLINE_FIXTURES.items()},
        "math500": str(math500),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", TELESCOPE_EXAMPLES)
def test_the_example_trains_one_step_on_a_tiny_model(name, shared_ray, datasets, tmp_path):
    path = EXAMPLES / f"{name}.yaml"
    source = yaml.safe_load(path.read_text())
    needs_sandbox = any(e["name"] in ("code", "i3_code") for e in source["environments"])
    if needs_sandbox and shutil.which("bwrap") is None:
        pytest.skip("the local code sandbox needs bubblewrap (`bwrap`), which is not installed")
    overrides = {
        **SHRUNK,
        "model": tiny_model(source["model"]),
        "run_dir": str(tmp_path / "runs"),
        "environments": offline(source["environments"], datasets),
    }
    if source.get("evals"):
        overrides["evals"] = shrunk_evals(source["evals"], datasets)
        # the example's eval server stays reserved for evals, beside the training server
        overrides["inference_num_workers"] = source["inference_num_workers"]
    cfg = load_config(path, overrides)
    run_dir = run_training(cfg, quiet=True, config_path=path)
    # the run gave its placement groups back to the session it found connected, so the next runs fit
    assert free_cpus() == CLUSTER_CPUS

    with RunReader(run_dir) as reader:
        assert reader.meta()["status"] == "finished"
        (step,) = reader.step_metrics()
        assert step["step"] == 0 and step["loss"] == step["loss"]  # present, not NaN
        kept = reader.rollouts(status="kept")
        assert len(kept) == 2 * 2  # prompts x group_size
        assert {r["env"] for r in kept} == {e["name"] for e in source["environments"]}
        reward_max = max(e.get("reward_max", 1) for e in source["environments"])
        assert all(0 <= r["reward"] <= reward_max for r in kept)
        for r in kept:  # the environment's own reward function scored every sample
            assert REWARD_METRICS[r["env"]] <= set(r["sample_metrics"]), (r["env"], r["sample_metrics"])
        evals = reader.rollouts(status="eval")
        if source.get("evals"):
            # the baseline eval before the first step: num_samples prompts of each eval
            assert {r["env"] for r in evals} == {e["name"] for e in source["evals"]}
            assert all(r["step"] == 0 for r in evals)
            for e in source["evals"]:
                assert len([r for r in evals if r["env"] == e["name"]]) == 2
                assert f"eval/{e['name']}/num_completions" in step
                if e.get("separate_eval_samples"):  # held out of the training environment of that name
                    held_out = {r["prompt_text"] for r in evals if r["env"] == e["name"]}
                    assert not held_out & {r["prompt_text"] for r in kept}
        else:
            assert evals == []
