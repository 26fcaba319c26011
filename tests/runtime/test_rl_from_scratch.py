"""The RL demonstration's pipeline at toy scale: a base model trained from scratch with SFT
(bench/sft_base.py) is a normal HF checkpoint that the engine scores and `refractor train` trains with
the example config (configs/examples/countdown_from_scratch.yaml), evals included."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

from refractor.config import load_config
from refractor.telemetry.query import RunReader
from refractor.trainer.checkpoint import is_complete_checkpoint

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import sft_base  # noqa: E402


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "base"
    args = argparse.Namespace(
        out=str(out),
        size="toy",
        steps=30,
        examples=300,
        tokens_per_batch=512,
        lr=3e-3,
        vocab_size=512,
        device="cpu",
        seed=0,
        shape=None,
        attempts=0,
        eval_at=set(),
    )
    return out, sft_base.train(args)


def test_worked_solutions_follow_the_expression():
    assert sft_base.worked_solution("(57 + 3) * 2") == (
        "<think> 57 + 3 = 60, 60 * 2 = 120 </think> <answer> (57 + 3) * 2 </answer>"
    )
    assert sft_base.worked_solution("(57 + 3) * 2", ["(57 * 3) - 2"]) == (
        "<think> 57 * 3 = 171, 171 - 2 = 169 no; 57 + 3 = 60, 60 * 2 = 120 yes </think> "
        "<answer> (57 + 3) * 2 </answer>"
    )


def test_searched_solutions_reject_misses_and_score_full_marks():
    from refractor.envs.builtin.countdown import CountdownEnvironment

    shape = {"procedural_min_numbers": 3, "procedural_max_numbers": 3, "procedural_max_number": 20}
    env = CountdownEnvironment(dataset_name="procedural", **shape)
    examples = sft_base.sft_examples(50, shape=shape, attempts=3)
    tries = 0
    for messages, completion in examples:
        question = messages[-1]["content"]
        nums = [int(n) for n in question.split("[")[1].split("]")[0].split(",")]
        target = int(question.split("equals ")[1].split(".")[0])
        sample = env.sample_from_row({"nums": nums, "target": target})
        assert env._equation_reward(completion, sample)[0] == 1.0, completion
        think = completion.split("<think> ")[1].split(" </think>")[0].split("; ")
        assert think[-1].endswith(" yes") and all(t.endswith(" no") for t in think[:-1]), completion
        for attempt in think[:-1]:  # a miss works out to a value other than the target
            assert int(attempt.removesuffix(" no").rsplit("= ", 1)[1]) != target, completion
        tries += len(think) - 1
        assert max(sample.metadata["nums"]) <= 20 and len(sample.metadata["nums"]) == 3
    assert 30 <= tries <= 120  # 0..3 misses per problem, 1.5 on average


@pytest.mark.slow
def test_sft_learns_and_writes_an_hf_checkpoint(base_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from refractor.models import CausalAttention, load_model

    out, result = base_model
    losses = result["losses"]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Using the numbers [3, 5]"}], tokenize=False
    )
    ids = torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_model(out, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
        got = ours.compute_logits(ours(ids, torch.arange(ids.numel()), CausalAttention()))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    accuracy = sft_base.held_out_accuracy(out, 4, max_tokens=24)
    assert 0.0 <= accuracy <= 1.0


@pytest.mark.slow
def test_the_example_config_trains_the_base_and_ends_with_a_checkpoint(base_model, tmp_path, monkeypatch):
    """``rl_from_scratch.py train-one`` as a device call runs it: the example config on the SFT base,
    evals included, ending with the checkpoint a later segment (``--resume``) continues from."""
    import json

    import rl_from_scratch

    monkeypatch.setenv("REFRACTOR_ENV_PATH", str(ROOT / "environments"))
    out, _ = base_model
    shape = {"procedural_min_numbers": 3, "procedural_max_numbers": 3, "procedural_max_number": 20}
    (out / "sft_summary.json").write_text(json.dumps({"args": {"shape": shape, "max_tokens": 16}}))
    toy = {
        "ray_address": "",
        "prompts_batch_size_for_trainer": 2,
        "group_size": 4,
        "max_concurrent_prompts_per_server": 4,
        "mixed_precision_dtype": None,
        "kv_cache_memory_gb": 0.25,
        "ray_inference_cpus_per_worker": 1,
        "ray_trainer_cpus_per_worker": 1,
        "colocate": False,
        "eval_samples": 4,
    }
    args = argparse.Namespace(
        base=out, run="grpo", out=tmp_path, rl_steps=2, overrides=json.dumps(toy), resume=False, train_seed=0
    )
    rl_from_scratch.stage_train_one(args)
    run_dir = tmp_path / "runs" / "grpo"
    with RunReader(run_dir) as reader:
        steps = reader.step_metrics()
        assert [m["step"] for m in steps if "timing_step_total" in m] == [0, 1]
        assert len(reader.rollouts(status="eval")) >= 2 * 4  # the baseline and the final eval
    assert is_complete_checkpoint(run_dir / "checkpoints" / "step_2")
    series = rl_from_scratch.series(run_dir)  # the report's reading: reward per step, time per span
    assert series["step"] == [0, 1] and len(series["train_reward"]) == 2
    assert series["train_key"].endswith("_equation_reward_mean"), series["train_key"]
    assert series["timing_means"]["timing_step_total"] > 0
    assert series["push_means"]["weight_sync"] >= series["push_means"]["weight_sync/pause"] > 0
    assert set(series["server_means"]) <= set(rl_from_scratch.SERVER_GAUGES)  # sampled every few seconds
    assert series["eval_step"] == [0, 2]
    # the next segment's config: the same run, resumed from that checkpoint, over a longer horizon
    resumed = load_config(
        rl_from_scratch.CONFIG,
        rl_from_scratch.run_overrides(
            out, "grpo", tmp_path / "runs", 5, {**toy, "resume_from_checkpoint": True}
        ),
    )
    assert resumed.resume_from_checkpoint is True and resumed.number_of_steps == 5
    assert resumed.checkpoint_every == rl_from_scratch.CHECKPOINT_NEVER_ON_SCHEDULE

    # the hand-off to a call on another machine: the policy in bfloat16 with its curve, the base beside it
    from safetensors.torch import load_file

    from refractor.trainer.convert import read_checkpoint_weights

    handoff = tmp_path / "handoff"
    first = argparse.Namespace(out=tmp_path, runs="grpo", continue_from=None, handoff=handoff, eval=4)
    rl_from_scratch.stage_handoff(first, out, rl_from_scratch.stage_report(first))
    record = json.loads((handoff / "grpo" / rl_from_scratch.HANDOFF).read_text())
    assert rl_from_scratch.steps_in(record["series"]) == 2
    # greedy held-out accuracy of the base (step 0) and of the policy handed off (step 2), each as
    # sft_base.py scores a model folder
    assert record["series"]["greedy_step"] == [0, 2]
    assert record["series"]["greedy"] == [
        sft_base.held_out_accuracy(model, 4, "cpu", 16, shape) for model in (out, handoff / "grpo")
    ]
    # at a temperature: the mean over seeded samples, 3 per problem (a 0/1 reward: a count of 12)
    sampled = [sft_base.held_out_accuracy(handoff / "grpo", 4, "cpu", 16, shape, 1.0, 3) for _ in range(2)]
    assert sampled[0] == sampled[1] and (12 * sampled[0]).is_integer() and 0 <= sampled[0] <= 1
    assert record["series"]["segments"] == [{"steps": 2, "train_seed": 0}]
    assert record["series"]["eval_step"] == [0, 2] and record["series"]["step"] == [0, 1]
    trained = read_checkpoint_weights(run_dir / "checkpoints" / "step_2")
    policy = load_file(handoff / "grpo" / "model.safetensors")
    assert policy.keys() <= trained.keys() and len(policy) >= len(trained) - 1  # a tied head is dropped
    for name, weight in policy.items():
        assert weight.dtype == torch.bfloat16 and torch.equal(weight, trained[name].bfloat16()), name
    base_weights = load_file(out / "model.safetensors")
    base_copy = load_file(handoff / "base" / "model.safetensors")
    assert all(torch.equal(base_copy[k], v.bfloat16()) for k, v in base_weights.items())
    assert (handoff / "base" / "tokenizer_config.json").is_file()
    assert json.loads((handoff / "base" / "sft_summary.json").read_text())["args"]["shape"] == shape

    # the next call continues the run from its policy on training problems it has not seen; a run
    # without a policy there starts from the base
    later = argparse.Namespace(
        out=tmp_path / "later", runs="grpo", continue_from=handoff, handoff=handoff, eval=4
    )
    assert rl_from_scratch.start_of(later, "grpo", handoff / "base") == (handoff / "grpo", 1000)
    assert rl_from_scratch.start_of(later, "control", handoff / "base") == (handoff / "base", 0)
    segment = argparse.Namespace(
        **{**vars(args), "base": handoff / "grpo", "out": later.out, "rl_steps": 1, "train_seed": 1000}
    )
    rl_from_scratch.stage_train_one(segment)
    with RunReader(later.out / "runs" / "grpo") as reader:
        config = reader.config()
    assert config["model"] == str(handoff / "grpo")
    assert config["environments"][0]["kwargs"]["seed"] == 1000 and config["evals"][0]["kwargs"]["seed"] == 1
    report = rl_from_scratch.stage_report(later)["grpo"]  # the two segments as one run
    assert report["step"] == [0, 1, 2] and report["eval_step"] == [0, 2, 2, 3]
    assert report["segments"] == [{"steps": 2, "train_seed": 0}, {"steps": 1, "train_seed": 1000}]
    assert len(report["pass@1"]) == 4
    assert report["greedy_step"] == [0, 2, 3] and len(report["greedy"]) == 3  # the start is scored once
    rl_from_scratch.stage_handoff(later, handoff / "base", {"grpo": report})
    record = json.loads((handoff / "grpo" / rl_from_scratch.HANDOFF).read_text())
    assert rl_from_scratch.steps_in(record["series"]) == 3
    assert record["series"]["segments"] == [{"steps": 2, "train_seed": 0}, {"steps": 1, "train_seed": 1000}]


def test_every_comparison_run_is_a_valid_config_of_the_base_s_problems(tmp_path):
    import json

    import rl_from_scratch

    shape = {"procedural_min_numbers": 3, "procedural_max_numbers": 3, "procedural_max_number": 50}
    (tmp_path / "sft_summary.json").write_text(json.dumps({"args": {"shape": shape, "max_tokens": 192}}))
    configs = {
        run: load_config(
            rl_from_scratch.CONFIG,
            rl_from_scratch.run_overrides(
                tmp_path, run, tmp_path / "runs", 35, {"learning_rate": 5e-5, "max_train_minutes": 4.1}
            ),
        )
        for run in rl_from_scratch.RUNS
    }
    assert configs["control"].learning_rate == 0.0 and configs["grpo"].learning_rate == 5e-5
    assert configs["grpo_lr2e-4"].learning_rate == 2e-4
    b64 = configs["grpo_b64"]
    assert (b64.prompts_batch_size_for_trainer, b64.learning_rate) == (64, 1e-4)
    assert all(c.max_train_minutes == 4.1 for c in configs.values())  # every run ends on its own
    assert {run: c.algorithm for run, c in configs.items()} == {
        "grpo": "grpo",
        "control": "grpo",
        "dr_grpo": "dr_grpo",
        "cispo": "cispo",
        "grpo_lr1e-4": "grpo",
        "grpo_lr2e-4": "grpo",
        "grpo_b64": "grpo",
    }
    for c in configs.values():
        assert c.max_tokens == 192 and c.number_of_steps == 35 and c.model == str(tmp_path)
        train, held_out = c.environments[0].kwargs, c.evals[0].kwargs
        assert train == {"dataset_name": "procedural", "seed": 0, **shape}
        assert held_out == {"dataset_name": "procedural", "seed": 1, **shape}


def test_two_segments_join_into_one_curve_with_step_weighted_means():
    import rl_from_scratch

    def segment(steps, evals, means, pushes=None):
        return {
            "step": list(range(steps)),
            "train_reward": [0.5] * steps,
            "eval_step": evals,
            "pass@1": [0.4] * len(evals),
            "pass@8": [0.7] * len(evals),
            "train_key": "reward__equation_reward_mean",
            "timing_step_total": [2.0] * steps,
            "timing_means": means,
            "segments": [{"steps": steps, "train_seed": 0}],
            **({"push_means": pushes} if pushes is not None else {}),
        }

    first = segment(3, [0, 3], {"timing_step_total": 2.0}, {"weight_sync": 0.3})
    second = segment(1, [0, 1], {"timing_step_total": 6.0, "timing_new": 1.0})  # an older hand-off's keys
    both = rl_from_scratch.joined(first, second, offset=3)
    assert both["step"] == [0, 1, 2, 3] and both["eval_step"] == [0, 3, 3, 4]
    assert len(both["pass@1"]) == 4 and len(both["timing_step_total"]) == 4
    # 3 steps at 2.0 and 1 at 6.0; a mean only one segment has is that segment's
    assert both["timing_means"] == {"timing_step_total": 3.0, "timing_new": 1.0}
    assert both["push_means"] == {"weight_sync": 0.3}
    assert rl_from_scratch.steps_in(both) == 4 and len(both["segments"]) == 2
