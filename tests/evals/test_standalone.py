"""`refractor eval` without a cluster: its config, the models it evaluates, what --resume skips."""

from __future__ import annotations

import json

import pytest

from refractor.config import ConfigError
from refractor.evals.passk import parse_pass_k, pass_at_k
from refractor.evals.standalone import StoredCompletion, combined_metrics, finished_prompts
from refractor.evals.standalone_config import (
    EvalTargetError,
    StandaloneEvalKeys,
    load_eval_config,
    resolve_targets,
)
from refractor.orchestrator.eval_runner import EvalResult
from refractor.records import EvalRollout


def native(path, step):
    d = path / f"step_{step}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"step": step, "trainer_step": step + 1}))
    return d


def hf(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_eval_keys_are_split_from_the_run_config_which_needs_no_environments(tmp_path):
    config = tmp_path / "eval.yaml"
    config.write_text(
        "model: some/model\nmax_tokens: 7\ncheckpoint_dir: runs/x\nwandb_run_path: a/b/c\n"
        "evals:\n  - {name: math500, num_samples: 10, pass_k: {at_k: [1, 4]}}\n"
    )
    keys, cfg = load_eval_config(config, ["--steps", "[10, 20]", "--temperature", "0.5"])
    assert keys.checkpoint_dir == "runs/x" and keys.steps == [10, 20]
    assert cfg.max_tokens == 7 and cfg.temperature == 0.5 and cfg.evals[0].num_samples == 10


def test_an_eval_config_without_evals_or_with_a_bad_key_names_it(tmp_path):
    with pytest.raises(ConfigError, match="`evals`"):
        load_eval_config(None, {"model": "m"})
    with pytest.raises(ConfigError, match="max_tokenz"):
        load_eval_config(None, {"evals": [{"name": "x"}], "max_tokenz": 3})
    with pytest.raises(ConfigError, match="checkpoints"):
        load_eval_config(None, {"evals": [{"name": "x"}], "checkpoints": [{"step": 1}]})


def test_every_checkpoint_of_a_run_folder_in_step_order_at_the_version_it_holds(tmp_path):
    run = tmp_path / "run"
    for step in (10, 2, 5):
        native(run / "checkpoints", step)
    (run / "checkpoints" / "step_7_tmp").mkdir()  # an unfinished save is no checkpoint
    (run / "checkpoints" / "step_8").mkdir()  # nor a folder without meta.json / config.json
    other = hf(tmp_path / "exported")
    # step_N was saved after training step N (0-indexed): it holds version N + 1, where training
    # reports its own evals of those weights; an explicit entry of the same step wins
    keys = StandaloneEvalKeys(checkpoint_dir=str(run), checkpoints=[{"path": str(other), "step": 6}])
    targets = resolve_targets(keys, "unused")
    assert [(t.step, t.native) for t in targets] == [(3, True), (6, False), (11, True)]
    assert targets[1].path == other and targets[0].tokenizer_dir == run / "checkpoints" / "step_2" / "hf_meta"
    only = resolve_targets(StandaloneEvalKeys(checkpoint_dir=str(run / "checkpoints"), steps=[10, 2]), "m")
    assert [(t.step, t.path.name) for t in only] == [(3, "step_2"), (11, "step_10")]
    with pytest.raises(EvalTargetError, match=r"N in \[3\]"):
        resolve_targets(StandaloneEvalKeys(checkpoint_dir=str(run), steps=[3]), "m")


def test_the_model_alone_is_evaluated_at_step_0_or_at_its_checkpoint_step(tmp_path):
    (target,) = resolve_targets(StandaloneEvalKeys(), str(hf(tmp_path / "model")))
    assert target.step == 0 and not target.native
    (target,) = resolve_targets(StandaloneEvalKeys(), str(native(tmp_path / "ck", 30)))
    assert target.step == 31 and target.native
    with pytest.raises(EvalTargetError, match="checkpoint_dir"):
        resolve_targets(StandaloneEvalKeys(checkpoint_dir=str(tmp_path / "missing")), "m")
    with pytest.raises(EvalTargetError, match=r"checkpoints\[0\]"):
        resolve_targets(StandaloneEvalKeys(checkpoints=[{"path": str(tmp_path)}]), "m")


def row(prompt, correct, step=3, name="e"):
    return StoredCompletion(step, name, prompt, {"correct": float(correct), "pass@2/correct": 9.0})


def test_resume_skips_prompts_whose_completions_are_all_stored_and_aggregates_old_and_new():
    stored = [row(0, 1), row(0, 0), row(1, 1), row(2, 0)]  # prompt 1 and 2 were interrupted halfway
    assert finished_prompts(stored, {"e": 2, "other": 2}) == {(3, "e", 0)}
    assert finished_prompts(stored, {"e": 1}) == {(3, "e", 0), (3, "e", 1), (3, "e", 2)}
    spec = parse_pass_k({"at_k": {"k": [1, 2], "metrics": ["correct"]}})
    new = []
    for prompt, scores in ((1, [1, 1]), (2, [0, 0])):
        for i, c in enumerate(scores):
            r = EvalRollout(100 + 2 * prompt + i, 50 + prompt, i, "e", step=3, prompt_index=prompt)
            r.sample_metrics = {"correct": float(c), "pass@1/correct": 0.5}
            new.append(r)
    result = EvalResult("e", 3, 3, {"policy_version": 3.0, "timing_total": 1.0, "correct": 0.5}, new)
    m = combined_metrics("e", spec, 3, stored, result, num_prompts=3)
    assert m["num_prompts"] == 3 and m["num_completions"] == 6 and m["policy_version"] == 3.0
    assert m["correct"] == pytest.approx(3 / 6)  # pass values written into rows are not metrics
    assert m["pass@2/correct"] == pytest.approx((pass_at_k(2, 1, 2) + 1.0 + 0.0) / 3)
    fewer = combined_metrics("e", spec, 3, stored, None, num_prompts=1)  # num_samples lowered since
    assert fewer["num_prompts"] == 1 and fewer["correct"] == 0.5 and fewer["policy_version"] == 3.0
