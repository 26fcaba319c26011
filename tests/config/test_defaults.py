"""Every default equals Telescope's, transcribed here independently of the schema
(docs/config.md#telescope-compatibility)."""

from __future__ import annotations

from pathlib import Path

import pytest

from refractor.config.docs import render_defaults
from refractor.config.schema import DELIBERATE_DEFAULT_CHANGES, IGNORED_KEYS, RefractorConfig

TELESCOPE_DEFAULTS = {
    "debug": False,
    "model": "Qwen/Qwen2.5-3B",
    "model_dtype": "float32",
    "mixed_precision_dtype": "bfloat16",
    "evals": [],
    "ray_address": "auto",
    "ray_auto_start_local": True,
    "ray_namespace": "telescope",
    "ray_log_to_driver": True,
    "ray_runtime_env": None,
    "ray_disable_runtime_env_hook": True,
    "ray_pin_py_executable": True,
    "ray_propagate_active_venv": True,
    "ray_propagate_run_dir": True,
    "ray_broadcast_init_timeout_s": 300,
    "ray_broadcast_prefer_loopback_if_single_node": True,
    "ray_shutdown_on_exit": False,
    "ray_inference_cpus_per_worker": 4.0,
    "ray_trainer_cpus_per_worker": 4.0,
    "ray_inference_placement_strategy": "PACK",
    "ray_trainer_placement_strategy": "PACK",
    "ray_placement_timeout_s": 900,
    "inference_num_workers": 2,
    "inference_tensor_parallel_size": 1,
    "trainer_num_workers": 2,
    "max_concurrent_prompts_per_server": 32,
    "prompts_batch_size_for_trainer": 16,
    "number_of_steps": 300,
    "max_async_rollout": 2,
    "discard_group_zero_advantage": True,
    "enable_prompt_prefetch": True,
    "prompt_prefetch_buffer_size": 24,
    "enable_individual_sample_lanes": True,
    "max_off_policy_steps": 8,
    "free_lane_after_generation": True,
    "eager_prepare_resources": False,
    "learning_rate": 1e-6,
    "weight_decay": 0.0,
    "grad_clip": 1.0,
    "lr_scheduler": "constant",
    "warmup_steps": 0,
    "min_lr_ratio": 0.0,
    "train_backend": "fsdp",
    "fsdp_context_parallel_size": 1,
    "megatron_tensor_parallel_size": 1,
    "megatron_pipeline_parallel_size": 1,
    "megatron_context_parallel_size": 1,
    "megatron_expert_parallel_size": 1,
    "megatron_global_batch_size": None,
    "megatron_disable_unified_memory_jit": True,
    "megatron_optimizer_cpu_offload": False,
    "megatron_optimizer_offload_fraction": 1.0,
    "megatron_overlap_cpu_optimizer_d2h_h2d": True,
    "megatron_use_precision_aware_optimizer": False,
    "megatron_main_grads_dtype": "float32",
    "megatron_main_params_dtype": "float32",
    "megatron_exp_avg_dtype": "float32",
    "megatron_exp_avg_sq_dtype": "float32",
    "megatron_grad_reduce_in_fp32": True,
    "megatron_gradient_checkpointing": True,
    "megatron_sequence_parallel": True,
    "megatron_use_distributed_optimizer": True,
    "megatron_overlap_grad_reduce": False,
    "megatron_use_transformer_engine": False,
    "megatron_fp8": False,
    "algorithm": "grpo",
    "number_of_minibatches": 1,
    "use_ppo_clip": False,
    "ppo_clip_ref_logprobs": "rollout",
    "clip_low": 0.4,
    "clip_high": 0.5,
    "clip_ratio_c": None,
    "sapo_tau_pos": 1.0,
    "sapo_tau_neg": 1.05,
    "dr_grpo_loss_agg_mode": "token_mean",
    "advantage_norm": "group",
    "use_tis": False,
    "tis_cap": 2.0,
    "tis_logprob_clamp": 20.0,
    "tis_mode": "truncate",
    "tis_floor": 0.0,
    "kl_penalty_tau": 0.0,
    "kl_estimator": "k2",
    "entropy_coef": 0.0,
    "entropy_chunk_size": 1024,
    "seq_is_masking": False,
    "seq_is_mask_low": 0.8,
    "seq_is_mask_high": 1.2,
    "filter_overlong": False,
    "overlong_penalty_factor": 0.0,
    "overlong_buffer_tokens": 256,
    "filter_gibberish": False,
    "gibberish_token_threshold": 100000,
    "gibberish_logprob_offset": 2.0,
    "filter_repetition": False,
    "repetition_compression_threshold": 10.0,
    "weight_broadcast_mode": "flattened_bucket",
    "weight_broadcast_bucket_mb": 256,
    "weight_broadcast_cpu_staging": False,
    "weight_broadcast_pin_memory": True,
    "weight_broadcast_free_grad_buffers": True,
    "seq_len": 4096,
    "pad_to_multiple_of": 64,
    "inference_host": "0.0.0.0",
    "inference_base_port": 8100,
    "gpu_memory_utilization": 0.9,
    "max_model_len": 4096,
    "max_num_seqs": None,
    "max_num_batched_tokens": None,
    "vllm_scheduling_policy": "priority",
    "enable_thinking": False,
    "chat_template": None,
    "group_size": 8,
    "temperature": 1.0,
    "max_tokens": 3700,
    "top_p": None,
    "interleaved_rollouts": True,
    "checkpoint_every": False,
    "checkpoint_save_training_state": True,
    "resume_from_checkpoint": False,
    "checkpoint_dir": None,
    "checkpoint_keep_last": None,
    "checkpoint_keep_every": None,
    "use_wandb": True,
    "wandb_project": "telescope",
    "wandb_run_name": "telescope_run",
    "wandb_tags": ["telescope"],
    "wandb_upload_code": True,
    "wandb_upload_logs": True,
    "wandb_upload_logs_detailed": False,
    "wandb_upload_logs_stdout": False,
    "wandb_code_max_file_size_mb": 2.0,
    "wandb_code_exclude_patterns": [
        ".git",
        ".venv",
        ".ruff_cache",
        ".mypy_cache",
        ".pytest_cache",
        "__pycache__",
        ".claude",
        ".env*",
        "assets",
        "checkpoints",
        "data",
        "dist",
        "logs",
        "specs",
        "stdout",
        "wandb",
        "*.pyc",
        "*.egg-info",
    ],
    "system_metrics_collection_interval_seconds": 1.0,
    "torch_memory_sample_interval_seconds": 0.1,
    "event_tail_window_seconds": 60,
    "event_block_duration_seconds": 1800,
    "event_upload_interval_seconds": 5,
    "metrics_logger_interval_seconds": 2.0,
    "ray_torch_memory_drain_interval_seconds": 0.5,
    "rollout_block_size": 500,
    "track_gpu_events": True,
    "eval_before_training": True,
    "eval_after_training": True,
    "eval_num_servers": 1,
    "eval_start_end_use_all_servers": True,
    "enable_vllm_tracing": True,
    "otlp_receiver_port": 4318,
}

# Keys refractor adds (not in Telescope); listed so a new key is a conscious decision.
REFRACTOR_KEYS = {
    "environments",
    "run_name",
    "run_dir",
    "seed",
    "inference_engine",
    "reward_timeout_s",
    "activation_checkpointing",
    "kv_cache_memory_gb",
}


def _default(name):
    return RefractorConfig.model_fields[name].get_default(call_default_factory=True)


@pytest.mark.parametrize("key", sorted(TELESCOPE_DEFAULTS))
def test_default_equals_telescopes(key):
    assert key in RefractorConfig.model_fields, f"Telescope key `{key}` missing from the schema"
    if key in DELIBERATE_DEFAULT_CHANGES:
        assert _default(key) != TELESCOPE_DEFAULTS[key]  # the documented difference is real
        return
    assert _default(key) == TELESCOPE_DEFAULTS[key]


def test_every_schema_key_is_telescopes_or_a_declared_addition():
    extra = set(RefractorConfig.model_fields) - set(TELESCOPE_DEFAULTS)
    # Helpers may add keys marked [refractor]; each must say so in its description.
    for key in extra:
        desc = RefractorConfig.model_fields[key].description or ""
        assert key in REFRACTOR_KEYS or desc.startswith("[refractor]"), (
            f"`{key}` is neither a Telescope key nor marked [refractor]"
        )


def test_ignored_keys_exist():
    assert set(IGNORED_KEYS) <= set(RefractorConfig.model_fields)


def test_committed_defaults_yaml_is_fresh():
    committed = Path(__file__).resolve().parents[2] / "configs" / "defaults.yaml"
    assert committed.read_text() == render_defaults(), (
        "configs/defaults.yaml is stale: run `refractor config defaults > configs/defaults.yaml`"
    )


def test_defaults_yaml_loads_back_to_the_defaults():
    import yaml

    data = yaml.safe_load(render_defaults())
    data["environments"] = [{"name": "countdown"}]
    cfg = RefractorConfig.model_validate(data)
    for key, value in data.items():
        if key != "environments":
            if isinstance(_default(key), tuple):  # YAML writes a tuple as a list
                value = tuple(value)
            assert getattr(cfg, key) == _default(key) == value or value is None and _default(key) is None
