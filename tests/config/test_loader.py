"""Layering, CLI override typing, error messages, cross-field rules and serialization."""

from __future__ import annotations

import textwrap

import pytest

from refractor.config import ConfigError, config_from_dict, config_to_dict, config_to_yaml, load_config
from refractor.config.loader import merge, parse_overrides, parse_yaml_value

ENV = {"environments": [{"name": "countdown"}]}


def cfg_with(**kw):
    return load_config(None, {**ENV, **kw})


def write(tmp_path, text, name="run.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


# ---------------------------------------------------------------- CLI override typing
@pytest.mark.parametrize(
    "args, expected",
    [
        (["--group_size", "4"], {"group_size": 4}),
        (["--learning_rate=1e-5"], {"learning_rate": 1e-5}),
        (["--learning-rate", "3.0e-6"], {"learning_rate": 3e-6}),
        (["--use_tis", "true"], {"use_tis": True}),
        (["--use_tis=False"], {"use_tis": False}),
        (["--debug"], {"debug": True}),
        (["--top_p", "null"], {"top_p": None}),
        (["--ray_address", ""], {"ray_address": ""}),
        (["--wandb_tags", "[a, b]"], {"wandb_tags": ["a", "b"]}),
        (["--ray_runtime_env", "{env_vars: {X: '1'}}"], {"ray_runtime_env": {"env_vars": {"X": "1"}}}),
        (["--model", "Qwen/Qwen2.5-0.5B"], {"model": "Qwen/Qwen2.5-0.5B"}),
        (
            ["--checkpoint_every", "10", "--debug", "--seed=3"],
            {"checkpoint_every": 10, "debug": True, "seed": 3},
        ),
    ],
)
def test_parse_overrides_types(args, expected):
    assert parse_overrides(args) == expected


def test_overrides_are_typed_by_the_schema():
    cfg = load_config(
        None,
        [
            "--environments",
            "[{name: countdown}]",
            "--learning_rate",
            "1e-5",
            "--group_size",
            "4",
            "--top_p",
            "0.9",
            "--max_num_seqs",
            "null",
            "--wandb_tags",
            "[x]",
        ],
    )
    assert cfg.learning_rate == 1e-5 and isinstance(cfg.group_size, int) and cfg.group_size == 4
    assert cfg.top_p == 0.9 and cfg.max_num_seqs is None and cfg.wandb_tags == ["x"]
    assert cfg.environments[0].name == "countdown" and cfg.environments[0].weight == 1.0


def test_bad_override_token():
    with pytest.raises(ConfigError, match="expected `--key value`"):
        parse_overrides(["group_size", "4"])


@pytest.mark.parametrize(
    "args", [["--learning_rate"], ["--learning_rate", "--seed", "3"], ["--seed=3", "--model"]]
)
def test_a_key_that_is_not_true_false_needs_a_value(args):
    """A bare `--learning_rate` used to become True, i.e. a learning rate of 1.0."""
    flag = next(a for a in args if a in ("--learning_rate", "--model"))
    with pytest.raises(ConfigError, match=f"command line: `{flag}` needs a value"):
        parse_overrides(args)


def test_a_bare_flag_is_true_for_true_false_keys():
    assert parse_overrides(["--debug", "--use-tis"]) == {"debug": True, "use_tis": True}
    with pytest.raises(
        ConfigError, match="unknown key `no_such_flag`"
    ):  # reported as unknown, not as valueless
        load_config(None, ["--environments", "[{name: countdown}]", "--no_such_flag"])


# ---------------------------------------------------------------- layers
def test_layers_file_then_cli_lists_replaced_dicts_merged(tmp_path):
    p = write(
        tmp_path,
        """
        environments:
          - name: countdown
            kwargs: {a: 1}
          - name: wordle
        ray_runtime_env: {env_vars: {A: "1"}, working_dir: "."}
        group_size: 4
        learning_rate: 1e-6
    """,
    )
    cfg = load_config(
        p,
        [
            "--group_size",
            "2",
            "--ray_runtime_env",
            "{env_vars: {B: '2'}}",
            "--environments",
            "[{name: hendrycks_math}]",
        ],
    )
    assert cfg.group_size == 2
    assert cfg.learning_rate == 1e-6
    assert cfg.ray_runtime_env == {"env_vars": {"A": "1", "B": "2"}, "working_dir": "."}
    assert [e.name for e in cfg.environments] == ["hendrycks_math"]
    assert cfg.user_keys == {"environments", "ray_runtime_env", "group_size", "learning_rate"}


def test_merge_semantics():
    assert merge({"a": {"x": 1, "y": [1]}, "b": [1, 2]}, {"a": {"y": [2]}, "b": [3]}) == {
        "a": {"x": 1, "y": [2]},
        "b": [3],
    }


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_non_mapping_file(tmp_path):
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [1, 2\n"))


def test_a_key_given_twice_names_both_lines(tmp_path):
    p = write(
        tmp_path, "environments: [{name: countdown}]\nlearning_rate: 1e-5\nseed: 1\nlearning_rate: 1e-3\n"
    )
    with pytest.raises(
        ConfigError, match=r"not valid YAML: key `learning_rate` appears twice, on lines 2 and 4"
    ):
        load_config(p)
    nested = write(tmp_path, "environments:\n  - name: countdown\n    weight: 1\n    weight: 2\n")
    with pytest.raises(ConfigError, match="key `weight` appears twice, on lines 3 and 4"):
        load_config(nested)


def test_yaml_merge_keys_still_override(tmp_path):
    p = write(
        tmp_path,
        "base: &b {name: countdown, weight: 1}\nenvironments: [{<<: *b, weight: 2}]\n",
    )
    with pytest.raises(ConfigError, match="unknown key `base`"):  # parsed fine; only the key is unknown
        load_config(p)


def test_an_alias_bomb_is_refused_before_it_is_built(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    p = write(tmp_path, "\n".join(lines) + "\n")  # 10**9 values once expanded
    with pytest.raises(ConfigError, match="expands to more than 100,000 values through YAML aliases"):
        load_config(p)


def test_a_binary_config_file_is_one_clear_error(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    with pytest.raises(ConfigError, match=r"config.yaml: not a text \(UTF-8\) file"):
        load_config(p)


# ---------------------------------------------------------------- error messages
def test_unknown_key_suggests_closest_and_names_file(tmp_path):
    p = write(tmp_path, "environments: [{name: countdown}]\nlearnig_rate: 1e-5\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    msg = str(err.value)
    assert str(p) in msg and "`learnig_rate`" in msg and "did you mean `learning_rate`" in msg


def test_unknown_cli_key_names_command_line():
    with pytest.raises(
        ConfigError, match=r"command line: unknown key `grup_size` \(did you mean `group_size`\?\)"
    ):
        load_config(None, {**ENV, "grup_size": 3})


def test_unknown_nested_key_in_environment_entry(tmp_path):
    p = write(tmp_path, "environments: [{name: countdown, wieght: 2}]\n")
    with pytest.raises(
        ConfigError, match=r"`environments\[0\]\.wieght`: unknown key \(did you mean `weight`\?\)"
    ):
        load_config(p)


def test_range_error_names_key_value_and_bound(tmp_path):
    p = write(tmp_path, "environments: [{name: countdown}]\nclip_low: 1.5\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    msg = str(err.value)
    assert "`clip_low` = 1.5" in msg and "less than or equal to 1" in msg and str(p) in msg


@pytest.mark.parametrize(
    "key, value, bound",
    [
        ("max_model_len", "1e12", "16777216"),
        ("kv_cache_memory_gb", "1e9", "16384"),
        ("seq_len", "1e12", "16777216"),
        ("max_tokens", "1e9", "16777216"),
        ("group_size", "1e9", "1048576"),
        ("prompts_batch_size_for_trainer", "1e9", "1048576"),
        ("inference_num_workers", "1e6", "65536"),
        ("weight_broadcast_bucket_mb", "1e12", "16777216"),
        ("trainer_call_timeout_s", "1e12", "10000000"),
    ],
)
def test_absurd_sizes_counts_and_timeouts_name_the_key_and_the_bound(tmp_path, key, value, bound):
    p = write(tmp_path, f"environments: [{{name: countdown}}]\n{key}: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert str(err.value) == f"{p}: `{key}` = {float(value)!r}: Input should be less than or equal to {bound}"


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_infinite_and_nan_numbers_are_refused(value):
    with pytest.raises(ConfigError, match="`learning_rate` = .*: Input should be a finite number"):
        cfg_with(learning_rate=parse_yaml_value(value))


def test_literal_error_lists_allowed_values():
    with pytest.raises(ConfigError, match=r"`algorithm` = 'ppo'.*'grpo'.*'sapo'"):
        cfg_with(algorithm="ppo")


def test_several_errors_reported_together():
    with pytest.raises(ConfigError) as err:
        cfg_with(group_size=0, temperature=-1)
    assert "`group_size`" in str(err.value) and "`temperature`" in str(err.value)


# ---------------------------------------------------------------- cross-field rules (reject + accept)
REJECT = [
    ({"use_tis": True, "use_ppo_clip": True}, "ppo_clip_ref_logprobs: batch"),
    ({"use_ppo_clip": True, "algorithm": "cispo"}, "own clipping"),
    ({"use_ppo_clip": True, "algorithm": "gspo"}, "own clipping"),
    ({"use_ppo_clip": True, "algorithm": "sapo"}, "own clipping"),
    ({"clip_ratio_c": 0.9, "use_ppo_clip": True}, "must be > 1.0"),
    ({"clip_ratio_c": 3.0}, "needs clipping"),
    ({"clip_ratio_c": 3.0, "algorithm": "sapo"}, "needs clipping"),
    ({"advantage_norm": "batch", "algorithm": "rloo"}, "not valid with `algorithm: rloo`"),
    ({"advantage_norm": "batch", "algorithm": "dr_grpo"}, "not valid with `algorithm: dr_grpo`"),
    ({"algorithm": "reinforce_pp"}, "requires `advantage_norm: batch`"),
    (
        {"inference_num_workers": 3, "inference_tensor_parallel_size": 2},
        "multiple of `inference_tensor_parallel_size`",
    ),
    ({"fsdp_context_parallel_size": 2, "seq_len": 4098}, "divisible by 2 x"),
    ({"fsdp_context_parallel_size": 2, "trainer_num_workers": 3}, "multiple of `fsdp_context_parallel_size`"),
    ({"fp8": True, "train_backend": "megatron"}, "`fp8: true` needs `train_backend: fsdp`"),
    ({"fp8": True, "pad_to_multiple_of": 8}, "needs `pad_to_multiple_of` (8) to be a multiple of 16"),
    (
        {"fp8": True, "fsdp_context_parallel_size": 8, "seq_len": 4096, "trainer_num_workers": 8},
        "needs `pad_to_multiple_of` (64) to be a multiple of 128",
    ),
    ({"environments": []}, "at least one environment"),
    (
        {"train_backend": "megatron", "megatron_exp_avg_dtype": "bfloat16"},
        "`megatron_exp_avg_dtype: bfloat16` needs `megatron_use_precision_aware_optimizer: true`",
    ),
    ({"evals": [{"name": "math500"}], "inference_num_workers": 1}, "at least one of the 1 inference server"),
    ({"evals": [{"name": "math500"}], "eval_num_servers": 2}, "eval_num_servers"),
    (
        {"enable_individual_sample_lanes": False, "free_lane_after_generation": True},
        "needs `enable_individual_sample_lanes",
    ),
    ({"max_tokens": 4096}, "below `max_model_len`"),
    ({"pad_to_multiple_of": 128, "seq_len": 64, "max_model_len": 4096}, "cannot exceed `seq_len`"),
    ({"use_tis": True, "tis_mode": "icepop", "tis_floor": 3.0}, "below `tis_cap`"),
    ({"inference_engine": "native", "inference_tensor_parallel_size": 2}, "no tensor parallelism"),
    ({"checkpoint_every": 0}, "must be >= 1"),
    ({"resume_from_checkpoint": -1}, "a step >= 0"),
    ({"number_of_minibatches": 200}, "exceeds the samples per step"),
    ({"evals": [{"name": "a"}, {"name": "a"}], "inference_num_workers": 4}, "must be unique"),
    ({"lora_sync": "adapter"}, "`lora_sync: adapter` needs `lora_rank` > 0"),
    (
        {"lora_sync": "adapter", "lora_rank": 640, "inference_engine": "vllm"},
        "`lora_rank` (640) is above the largest LoRA rank vLLM serves (512)",
    ),
    ({"lora_sync": "adapter", "lora_rank": 8, "inference_sleep_level": 2}, "use `inference_sleep_level: 1`"),
    (
        {"lora_rank": 8, "lora_modules_to_save": ["wte"]},
        "`lora_modules_to_save` must name some of embed_tokens",
    ),
    ({"lora_modules_to_save": ["embed_tokens"]}, "`lora_modules_to_save` needs `lora_rank` > 0"),
]

ACCEPT = [
    {"use_tis": True, "use_ppo_clip": True, "ppo_clip_ref_logprobs": "batch"},
    {"use_ppo_clip": True, "algorithm": "rloo"},
    {"clip_ratio_c": 3.0, "use_ppo_clip": True},
    {"clip_ratio_c": 3.0, "algorithm": "cispo"},
    {"clip_ratio_c": 3.0, "algorithm": "gspo"},
    {"advantage_norm": "batch", "algorithm": "grpo"},
    {"algorithm": "reinforce_pp", "advantage_norm": "batch"},
    {"inference_num_workers": 4, "inference_tensor_parallel_size": 2},
    {"fsdp_context_parallel_size": 2, "seq_len": 4096, "trainer_num_workers": 2},
    {"fp8": True},  # the default pad multiples (64, 4096) suit float8 GEMMs
    {"fp8": True, "trainer_pass_pad_multiple": 0},
    {"evals": [{"name": "math500"}], "inference_num_workers": 2},
    {"evals": [{"name": "math500"}], "inference_num_workers": 1, "eval_num_servers": 0},
    {"inference_num_workers": 1},  # no evals: eval_num_servers is irrelevant
    {"enable_individual_sample_lanes": False},  # free_lane_after_generation follows it
    {"max_tokens": 4095},
    {"use_tis": True, "tis_mode": "icepop", "tis_floor": 0.5},
    {"checkpoint_every": 5, "resume_from_checkpoint": True},
    {"checkpoint_every": True, "resume_from_checkpoint": 3},
    {"lora_sync": "adapter", "lora_rank": 8, "inference_engine": "native"},
    {
        "lora_sync": "adapter",
        "lora_rank": 8,
        "inference_sleep_level": 2,
        "inference_sleep_during_training": False,
    },
    {"lora_sync": "merged", "lora_rank": 8, "inference_engine": "vllm"},
    {"lora_sync": "adapter", "lora_rank": 8, "inference_engine": "vllm"},
    {"lora_sync": "merged", "lora_rank": 640, "inference_engine": "vllm"},
    {"lora_rank": 8, "lora_modules_to_save": ("embed_tokens", "lm_head"), "lora_sync": "adapter"},
    {
        "lora_rank": 8,
        "lora_modules_to_save": ("lm_head",),
        "lora_sync": "adapter",
        "inference_engine": "vllm",
    },
]


@pytest.mark.parametrize("overrides, message", REJECT)
def test_cross_field_rule_rejects(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg_with(**overrides)


@pytest.mark.parametrize("overrides", ACCEPT)
def test_cross_field_rule_accepts(overrides):
    cfg = cfg_with(**overrides)
    for k, v in overrides.items():
        if k not in ("evals",):
            assert getattr(cfg, k) == v


def test_free_lane_follows_individual_lanes_when_unset():
    assert cfg_with(enable_individual_sample_lanes=False).free_lane_after_generation is False
    assert cfg_with().free_lane_after_generation is True


def test_environment_entry_reward_range():
    with pytest.raises(ConfigError, match="reward_min"):
        load_config(None, {"environments": [{"name": "x", "reward_min": 2, "reward_max": 1}]})
    with pytest.raises(ConfigError, match=r"`environments\[0\]\.weight` = 0"):
        load_config(None, {"environments": [{"name": "x", "weight": 0}]})


# ---------------------------------------------------------------- frozen + serialization
def test_frozen():
    cfg = cfg_with()
    with pytest.raises(Exception, match="frozen"):
        cfg.learning_rate = 1.0


def test_round_trip_dict_and_yaml(tmp_path):
    cfg = cfg_with(
        evals=[{"name": "math500", "pass_k": {"at_k": {"k": [1, 4]}}}],
        top_p=0.95,
        learning_rate=3e-7,
        ray_runtime_env={"env_vars": {"A": "1"}},
        checkpoint_every=7,
        resume_from_checkpoint=True,
        inference_num_workers=2,
    )
    import json

    dumped = cfg.model_dump()
    assert config_from_dict(config_to_dict(cfg)).model_dump() == dumped
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))).model_dump() == dumped
    p = tmp_path / "resolved.yaml"
    p.write_text(config_to_yaml(cfg))
    assert load_config(p).model_dump() == dumped


def test_pickle_round_trip_keeps_user_keys():
    import pickle

    cfg = cfg_with(group_size=2)
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and again.user_keys == {"environments", "group_size"}


def test_telescope_yaml_loads_unchanged_with_notices(tmp_path, capsys):
    p = write(
        tmp_path,
        """
        model: Qwen/Qwen2.5-3B
        inference_num_workers: 2
        trainer_num_workers: 2
        prompts_batch_size_for_trainer: 16
        group_size: 8
        number_of_steps: 300
        learning_rate: 1e-6
        max_tokens: 3600
        tis_cap: 10
        tis_logprob_clamp: 2
        entropy_chunk_size: 2048
        use_wandb: true
        wandb_project: telescope
        wandb_upload_code: true
        wandb_upload_logs_stdout: true
        megatron_tensor_parallel_size: 1
        megatron_overlap_grad_reduce: true
        environments:
          - name: countdown
            weight: 1.0
            reward_min: 0
            reward_max: 2
            kwargs:
              add_thinking_prefix: true
    """,
    )
    cfg = load_config(p)
    assert cfg.tis_cap == 10.0 and cfg.environments[0].kwargs == {"add_thinking_prefix": True}
    err = capsys.readouterr().err
    assert "`wandb_upload_logs_stdout` is accepted for Telescope compatibility but has no effect" in err
    assert "`megatron_overlap_grad_reduce`" in err and "wandb_upload_code" not in err
    assert "`megatron_tensor_parallel_size`" not in err  # the Megatron trainer reads it
    assert "wandb_project" not in err


def test_serialized_key_order_follows_the_documented_sections():
    from refractor.config.schema import SECTIONS

    keys = list(config_to_dict(cfg_with()))
    assert keys == [name for _, section in SECTIONS for name in section.model_fields]
    assert keys[:2] == ["debug", "model"]
