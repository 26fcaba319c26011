"""The one configuration model: every Telescope training key plus refractor's own.

Fields are grouped in section classes (the order of ``configs/defaults.yaml``); ``RefractorConfig``
inherits them all and adds the cross-field rules. Defaults live here, in code, and equal Telescope's
defaults except where ``DELIBERATE_DEFAULT_CHANGES`` says why not (docs/config.md#telescope-compatibility).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from refractor.megatron.layout import (
    MOE_TENSOR_PARALLEL,
    ParallelSizes,
    layout_errors,
    read_model_shape,
    transformer_engine_installed,
)

Dtype = Literal["float32", "float16", "bfloat16"]
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
# the inference engine's share of its GPU when gpu_memory_utilization is not set: colocated, the
# trainer rank on the same GPU needs the rest (weights, gradients, optimizer state, activations)
SPLIT_GPU_MEMORY_UTILIZATION = 0.9
COLOCATED_GPU_MEMORY_UTILIZATION = 0.4

# Upper bounds of sizes, counts and durations: far beyond any real run, they turn a typo (`1e12`)
# into an error naming the key instead of an allocation that fails, or hangs, at run time.
MAX_TOKENS = 2**24  # context lengths, token budgets and chunks (16M tokens)
MAX_COUNT = 2**20  # prompts, samples, sequences and batches
MAX_WORKERS = 2**16  # GPUs, ranks and servers
MAX_CPUS = 4096  # CPUs of one Ray bundle
MAX_MIB = 2**24  # buffers in MiB (16 TiB)
MAX_GIB = 16384  # memory budgets in GiB (16 TiB)
MAX_SECONDS = 10**7  # timeouts and intervals (about four months)

# the decoder projections that can carry a LoRA adapter (refractor.models.lora.ALL_PROJECTIONS; a
# test keeps the two equal: this module does not import torch)
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VLLM_MAX_LORA_RANK = 512  # refractor.inference.vllm.adapter.VLLM_MAX_LORA_RANKS[-1] (a test keeps them equal)
# the modules that can train in full beside the adapters (refractor.models.lora.MODULES_TO_SAVE; the
# same test keeps the two equal)
LORA_MODULES_TO_SAVE = ("embed_tokens", "lm_head")

_WANDB_CODE_EXCLUDES = [
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
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class EnvironmentEntry(_Strict):
    name: str = Field(
        description="Environment name: a built-in, a folder under the environments path, or an entry point."
    )
    weight: float = Field(1.0, gt=0, description="Sampling weight (normalized over all environments).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Constructor kwargs of the environment.")
    reward_min: float | None = Field(
        None, description="Lower end of the reward range (dashboard colouring, normalization)."
    )
    reward_max: float | None = Field(None, description="Upper end of the reward range.")

    @model_validator(mode="after")
    def _range(self) -> EnvironmentEntry:
        if self.reward_min is not None and self.reward_max is not None and self.reward_min >= self.reward_max:
            raise ValueError(f"reward_min ({self.reward_min}) must be below reward_max ({self.reward_max})")
        return self


class EvalEntry(_Strict):
    name: str = Field(description="Dedicated eval or environment name.")
    eval_every: int = Field(10, ge=1, description="Run this eval every N training steps.")
    pass_k: dict[str, Any] = Field(
        default_factory=dict, description='{"at_k": {"metrics": [...], "k": [...]}, "pow_k": {...}}'
    )
    num_samples: int = Field(-1, ge=-1, description="Evaluate the first N samples; -1 = all.")
    separate_eval_samples: bool = Field(
        False, description="Hold these samples out of training for the same environment."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Constructor kwargs of the eval/environment."
    )
    temperature: float | None = Field(
        None, ge=0, description="Sampling override; null inherits training sampling."
    )
    top_p: float | None = Field(None, gt=0, le=1, description="Sampling override; null inherits.")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="Sampling override; null inherits.")


class GeneralKeys(_Strict):
    debug: bool = Field(False, description="Verbose console and Ray worker log forwarding (also --debug).")
    model: str = Field(
        "Qwen/Qwen2.5-3B",
        description="HF model id (from the local HF cache) or a local checkpoint directory.",
    )
    model_dtype: Dtype = Field("float32", description="Dtype of the trainer's master weights.")
    mixed_precision_dtype: Dtype | None = Field(
        "bfloat16",
        description="Trainer compute dtype, both backends (gradients reduced in fp32; CPU trainers "
        "compute in fp32); null = no mixed precision.",
    )
    environments: list[EnvironmentEntry] = Field(
        default_factory=list, description="Training environments (required, non-empty)."
    )
    evals: list[EvalEntry] = Field(default_factory=list, description="Periodic evals.")
    # refractor additions
    run_name: str | None = Field(
        None,
        description="[refractor] Run name; the run lives in <run_dir>/<run_name>. null = timestamped name.",
    )
    run_dir: str = Field("runs", description="[refractor] Parent folder of run directories.")
    seed: int = Field(0, description="[refractor] Seed for prompt sampling, sampling seeds and model init.")


class RayKeys(_Strict):
    ray_address: str = Field("auto", description='ray.init address; "" always starts a local cluster.')
    ray_auto_start_local: bool = Field(
        True, description='Start a local Ray cluster when connecting to "auto" fails.'
    )
    ray_namespace: str = Field("refractor", description="Ray namespace.")
    ray_log_to_driver: bool = Field(
        True, description="Forward worker logs to the driver (forced off unless debug)."
    )
    ray_runtime_env: dict[str, Any] | None = Field(
        None, description="User runtime_env, extended with refractor's defaults."
    )
    ray_disable_runtime_env_hook: bool = Field(
        True, description="Drop RAY_RUNTIME_ENV_HOOK (avoids per-worker env builds)."
    )
    ray_pin_py_executable: bool = Field(True, description="Workers use the driver's Python executable.")
    ray_propagate_active_venv: bool = Field(
        True, description="Forward VIRTUAL_ENV / UV_PROJECT_ENVIRONMENT to workers."
    )
    ray_propagate_run_dir: bool = Field(True, description="Forward the run directory to workers.")
    ray_broadcast_init_timeout_s: int = Field(
        300, ge=1, le=MAX_SECONDS, description="Timeout for creating the weight-broadcast group."
    )
    ray_broadcast_prefer_loopback_if_single_node: bool = Field(
        True, description="Use 127.0.0.1 for the broadcast rendezvous on one node."
    )
    ray_shutdown_on_exit: bool = Field(
        False,
        description="At the end of a run, also leave a Ray cluster the run joined (ray.shutdown(): this "
        "process disconnects, the cluster goes on); a cluster the run started always stops.",
    )
    ray_inference_cpus_per_worker: float = Field(
        4.0, ge=0, le=MAX_CPUS, description="CPUs per inference server bundle."
    )
    ray_trainer_cpus_per_worker: float = Field(4.0, ge=0, le=MAX_CPUS, description="CPUs per trainer bundle.")
    ray_inference_placement_strategy: PlacementStrategy = Field(
        "PACK", description="Placement strategy of inference servers."
    )
    ray_trainer_placement_strategy: PlacementStrategy = Field(
        "PACK", description="Placement strategy of trainer ranks."
    )
    ray_placement_timeout_s: int = Field(
        900, ge=1, le=MAX_SECONDS, description="Placement-group readiness and server start-up timeout."
    )
    ray_inference_resources: dict[str, float] = Field(
        default_factory=dict,
        description="[refractor] Custom Ray resources each inference server bundle also asks for "
        "(e.g. {inference_node: 1} puts servers on nodes started with that resource).",
    )
    ray_trainer_resources: dict[str, float] = Field(
        default_factory=dict,
        description="[refractor] Custom Ray resources each trainer-rank bundle also asks for.",
    )
    heartbeat_interval_s: float = Field(
        10.0,
        gt=0,
        le=MAX_SECONDS,
        description="[refractor] How often the driver checks every inference server "
        "(/health and its process).",
    )
    heartbeat_timeout_s: float = Field(
        120.0,
        gt=0,
        le=MAX_SECONDS,
        description="[refractor] A server that has not answered /health for this long stops the run, named.",
    )
    inference_restart_on_failure: int = Field(
        2,
        ge=0,
        le=MAX_COUNT,
        description="[refractor] How many times each inference server that dies or hangs is restarted "
        "(it gets the current weights, its groups run again elsewhere meanwhile); one more failure "
        "stops the run, named. 0: the first failure stops the run.",
    )
    trainer_call_timeout_s: float = Field(
        3600.0,
        gt=0,
        le=MAX_SECONDS,
        description="[refractor] A trainer step, weight sync or checkpoint that takes longer stops the run, "
        "naming the ranks that did not finish (a hung collective).",
    )


class WorkerKeys(_Strict):
    inference_num_workers: int = Field(
        2,
        ge=1,
        le=MAX_WORKERS,
        description="Inference GPUs (servers = this / inference_tensor_parallel_size).",
    )
    inference_tensor_parallel_size: int = Field(
        1, ge=1, le=MAX_WORKERS, description="Tensor parallelism per inference server (vLLM)."
    )
    trainer_num_workers: int = Field(2, ge=1, le=MAX_WORKERS, description="Trainer ranks (one GPU each).")
    inference_engine: Literal["auto", "vllm", "native"] = Field(
        "auto",
        description="[refractor] auto = the native engine for the architectures it implements (Llama, "
        "Qwen2/2.5, Qwen3), vLLM for the others; the run's first lines say which and why.",
    )
    colocate: bool | Literal["auto"] = Field(
        "auto",
        description="[refractor] Servers and trainer ranks share GPUs (one server and one rank per GPU). "
        "auto = share when the cluster has fewer GPUs than inference_num_workers + trainer_num_workers.",
    )
    inference_sleep_during_training: bool | Literal["auto"] = Field(
        "auto",
        description="[refractor] Colocated synchronous runs: the servers give their GPU memory back while "
        "the trainer steps (KV cache freed, weights as inference_sleep_level says) and take it back for "
        "the weight update and the next generation. auto = on when colocated and max_async_rollout is 0.",
    )
    inference_sleep_level: Literal[1, 2] = Field(
        1,
        description="[refractor] What a sleeping server does with its weights: 1 = offload them to pinned "
        "host memory; 2 = discard them (the weight update refills them: less copying, but a failed "
        "update leaves the server without weights until the next one).",
    )


class OrchestratorKeys(_Strict):
    max_concurrent_prompts_per_server: int = Field(
        32, ge=1, le=MAX_COUNT, description="Groups in flight per server (lanes = this x group_size)."
    )
    prompts_batch_size_for_trainer: int = Field(
        16, ge=1, le=MAX_COUNT, description="Kept groups per training step."
    )
    number_of_steps: int = Field(300, ge=1, description="Training steps (also the LR-schedule horizon).")
    max_train_minutes: float | None = Field(
        None,
        gt=0,
        description="[refractor] Wall-clock budget of the training loop (from its start, after the baseline "
        "eval): after the step during which it runs out the run ends as if that were the last step (final "
        "eval, checkpoint when checkpoint_every is on); the LR schedule still spans number_of_steps. "
        "Null: none.",
    )
    max_async_rollout: int = Field(
        2, ge=0, le=MAX_COUNT, description="How many steps generation may run ahead of training."
    )
    discard_group_zero_advantage: bool = Field(
        True, description="Drop groups whose advantages are all equal (group_size > 1)."
    )
    enable_prompt_prefetch: bool = Field(True, description="Render prompts ahead of dispatch.")
    prompt_prefetch_buffer_size: int = Field(
        24, ge=0, le=MAX_COUNT, description="Prefetch queue size; 0 disables."
    )
    enable_individual_sample_lanes: bool = Field(
        True, description="One lane per sample instead of per group."
    )
    max_off_policy_steps: int = Field(
        8, ge=-1, description="Cancel rollouts more than N policy versions old; -1 disables."
    )
    free_lane_after_generation: bool = Field(
        True,
        description="Release a lane when generation ends, before scoring (needs individual lanes; "
        "defaults to false without them).",
    )
    eager_prepare_resources: bool = Field(
        False,
        description="Await every env's prepare_resources() (sandbox pools...) before the baseline eval and "
        "the first rollout; false: they run beside the first rollouts. A failure stops the run, named.",
    )
    reward_timeout_s: float = Field(
        120.0,
        gt=0,
        le=MAX_SECONDS,
        description="[refractor] Per-sample reward timeout; a timeout discards the rollout.",
    )
    deterministic_rollouts: bool = Field(
        False,
        description="[refractor] Reproducible rollouts: every request carries a sampling seed derived "
        "from `seed` and the prompt's position in the prompt stream; batches are filled in prompt-stream "
        "order (a finished group waits for earlier ones), not completion order; batch s is generated by "
        "exactly one policy version, max(s - max_async_rollout, the newest version saved by "
        "checkpoint_every), and weights never change under a running request, so a run resumed from a "
        "checkpoint_every checkpoint matches the uninterrupted run. Costs throughput: groups dispatched past "
        "a batch's cut run again when the next batch needs newer weights, finished groups wait for slower "
        "earlier ones, the pipeline drains at each checkpoint, and max_async_rollout above 1 only adds "
        "staleness. Still timing-dependent: reward timeouts and server errors. Bitwise-equal rollouts also "
        "need an engine whose numerics do not depend on which requests share a batch (see "
        "serialize_generation).",
    )
    dispatch_only_needed_groups: bool = Field(
        False,
        description="[refractor] Create a new group only while the batches the async gate leaves open "
        "still lack groups (counting the ones in flight, scaled up by the observed keep rate), instead of "
        "whenever a lane is free. Removes the over-dispatch that max_async_rollout then discards as stale "
        "(most in synchronous mode, max_async_rollout 0; see bench/RESULTS.md); a run whose groups are "
        "often discarded gets a slower tail.",
    )
    serialize_generation: bool = Field(
        False,
        description="[refractor] Send each inference server one generation request at a time (the rest "
        "wait in the orchestrator). With deterministic_rollouts this makes rollouts bitwise reproducible on "
        "engines whose results depend on which requests share a batch: the native engine (on CPU, MKL GEMM "
        "results change with the number of rows) and vLLM outside its batch-invariant mode. Very slow; for "
        "tests, debugging and reproducibility checks.",
    )


class TrainerKeys(_Strict):
    learning_rate: float = Field(
        1e-6, ge=0, description="AdamW learning rate (0 freezes the policy; useful as a control run)."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, ge=0, description="Max grad norm; 0 reports the norm without clipping.")
    lr_scheduler: Literal["none", "constant", "linear", "cosine"] = Field(
        "constant", description="LR schedule."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="Floor of linear/cosine decay as a fraction of learning_rate."
    )
    train_backend: Literal["fsdp", "megatron"] = Field("fsdp", description="Training backend.")
    fsdp_context_parallel_size: int = Field(
        1,
        ge=1,
        description="Context parallelism for FSDP: this many trainer ranks share every packed row, each "
        "running 1/N of its tokens with the row's keys and values all-gathered per layer (native models; "
        "exact: same loss and gradients as one rank).",
    )
    lora_rank: int = Field(
        0,
        ge=0,
        description="[refractor] LoRA: rank of the adapters trained on a frozen base (0 = off: the whole "
        "model trains). Native models (Llama / Qwen2 / Qwen3); lora_sync says what the servers get.",
    )
    lora_alpha: float = Field(
        32.0, gt=0, description="[refractor] LoRA scale numerator: the update is (alpha / rank) B A."
    )
    lora_dropout: float = Field(
        0.0, ge=0, lt=1, description="[refractor] Dropout on the adapters' input (training only)."
    )
    lora_target_modules: tuple[str, ...] = Field(
        LORA_PROJECTIONS,
        description="[refractor] The decoder projections that get adapters (default: all attention and "
        "MLP projections).",
    )
    lora_init: Literal["default", "gaussian"] = Field(
        "default",
        description="[refractor] Initialization of A (B starts at zero): default = Kaiming-uniform as "
        "nn.Linear and PEFT, gaussian = normal with std 1/rank.",
    )
    lora_sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="[refractor] What the weight sync pushes with LoRA: merged = every adapted weight as "
        "W + (alpha / rank) B A (every engine serves it); adapter = only the adapters (A, B and the scale, "
        "a small fraction of the bytes), applied at run time over the base the servers loaded from `model` "
        "(native: its adapter buffers; vLLM: its LoRA support, for requests that name the served model).",
    )
    lora_modules_to_save: tuple[str, ...] = Field(
        (),
        description="[refractor] LoRA: modules trained in full beside the adapters, as PEFT's "
        "modules_to_save: embed_tokens and / or lm_head (on a tied model both name the one embedding). "
        "Synced and checkpointed with the adapters; needed when the frozen head caps the logits (a "
        "randomly initialized model).",
    )
    fsdp_cpu_offload: bool = Field(
        False,
        description="[refractor] FSDP2 keeps parameters, gradients and AdamW state in host memory (pinned "
        "on CUDA); each layer's parameters are copied to the GPU for its forward and backward and AdamW "
        "steps on the CPU: larger models fit fewer GPUs, at a cost in step time (a 7B shape on one GPU: "
        "seconds per step, ~130 GB of host RAM). Use it only when the state does not fit the GPUs.",
    )
    fp8: bool = Field(
        False,
        description="[refractor] FSDP trainer: run the decoder layers' q/k/v/o and gate/up/down GEMMs in "
        "float8 through torchao (tensorwise dynamic scaling; FSDP2 all-gathers those weights in float8). "
        "Needs GPUs with FP8 tensor cores (compute capability >= 8.9: Hopper, Ada), refused elsewhere, and "
        "token counts in multiples of 16 (pad_to_multiple_of). Master weights, checkpoints, export and "
        "weight sync are unchanged; losses differ from bf16 by fp8 rounding. Pays off from ~3B parameters "
        "(1.10x the bf16 step at 3B on an H200; slower at 1.5B and below).",
    )
    activation_checkpointing: bool | Literal["selective", "auto"] = Field(
        "auto",
        description="[refractor] Recompute decoder layers in the backward pass. true: the whole layer "
        "(least memory); selective: keep the outputs of its matmuls and attention, recompute only the "
        "elementwise glue (RMSNorm, rotary, SiLU gate); false: keep everything (fastest, most memory); "
        "auto: the fastest mode whose predicted peak fits trainer_memory_fraction of the GPU (logged; "
        "true on CPU).",
    )
    trainer_memory_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="[refractor] Share of each trainer GPU that activation_checkpointing: auto plans for; "
        "null = 0.9, less the servers' share when they keep their memory on the same GPUs.",
    )
    trainer_compile: bool = Field(
        True,
        description="[refractor] torch.compile each decoder layer of the trainer, activation "
        "checkpointing included (CUDA only; CPU trainers run eagerly).",
    )
    trainer_max_tokens_per_forward: int = Field(
        16384,
        ge=0,
        le=MAX_TOKENS,
        description="[refractor] CUDA trainer: the packed rows of a minibatch (each <= seq_len) are "
        "concatenated into forward passes of up to this many tokens (samples stay isolated); fewer, longer "
        "passes cut per-layer host overhead. 0 = one pass per row. CPU trainers run one pass per row.",
    )
    trainer_pass_pad_multiple: int = Field(
        4096,
        ge=0,
        le=MAX_TOKENS,
        description="[refractor] Compiled CUDA trainer: every forward pass is padded to a multiple of "
        "this many tokens (padding is masked out of attention and loss), so the compiled decoder layers see "
        "a few static lengths (<= trainer_max_tokens_per_forward / this) instead of a new one each step; "
        "compiling a layer for dynamic shapes is impractically slow. 0 = no padding (lengths vary; not "
        "recommended with trainer_compile).",
    )


class MegatronKeys(_Strict):
    megatron_tensor_parallel_size: int = Field(1, ge=1, description="Megatron TP.")
    megatron_pipeline_parallel_size: int = Field(1, ge=1, description="Megatron PP.")
    megatron_context_parallel_size: int = Field(1, ge=1, description="Megatron CP.")
    megatron_expert_parallel_size: int = Field(1, ge=1, description="Megatron EP.")
    megatron_global_batch_size: int | None = Field(
        None, description="Unused (kept for Telescope compatibility)."
    )
    megatron_disable_unified_memory_jit: bool = Field(True, description="Skip a slow Megatron JIT at import.")
    megatron_optimizer_cpu_offload: bool = Field(
        False,
        description="Step a share of the parameters (megatron_optimizer_offload_fraction) on the host: "
        "their float32 master copy and AdamW state in host memory.",
    )
    megatron_optimizer_offload_fraction: float = Field(
        1.0,
        ge=0,
        le=1,
        description="With megatron_optimizer_cpu_offload: the share of each rank's parameter elements "
        "stepped on the host (parameters in order, as Megatron-Core picks them).",
    )
    megatron_overlap_cpu_optimizer_d2h_h2d: bool = Field(
        True,
        description="With megatron_optimizer_cpu_offload on CUDA: copy gradients to the host and weights "
        "back from pinned memory on a side stream (no effect on a CPU trainer).",
    )
    megatron_use_precision_aware_optimizer: bool = Field(
        False, description="Let the four dtype keys below choose lower-precision gradients and AdamW moments."
    )
    megatron_main_grads_dtype: str = Field(
        "float32",
        description="Gradients accumulated and reduced in: float32, or bfloat16 (the bf16 compute dtype's "
        "own gradients; needs mixed_precision_dtype: bfloat16).",
    )
    megatron_main_params_dtype: str = Field("float32", description="Master weights: float32 only.")
    megatron_exp_avg_dtype: str = Field(
        "float32",
        description="AdamW first moment stored in: float32, bfloat16 or float16 (scaled per tensor).",
    )
    megatron_exp_avg_sq_dtype: str = Field(
        "float32",
        description="AdamW second moment stored in: float32, bfloat16 or float16 (scaled per tensor).",
    )
    megatron_grad_reduce_in_fp32: bool = Field(
        True,
        description="false: sum float32 gradients over the data-parallel replicas in the compute dtype "
        "(no effect with float32 compute or bfloat16 main grads).",
    )
    megatron_gradient_checkpointing: bool = Field(
        True, description="Recompute each decoder layer in the backward (keeps only the layers' inputs)."
    )
    megatron_sequence_parallel: bool = Field(
        True,
        description="Sequence parallelism: with TP > 1, the activations between attention and the MLP "
        "(norms, residual stream) split along the sequence among the tensor-parallel ranks (false "
        "unless set).",
    )
    megatron_use_distributed_optimizer: bool = Field(
        True,
        description="Split the AdamW state among the data-parallel replicas: each steps its share of the "
        "parameters and broadcasts it.",
    )
    megatron_overlap_grad_reduce: bool = Field(False, description="Overlap grad reduce.")
    megatron_use_transformer_engine: bool = Field(False, description="TransformerEngine layer spec.")
    megatron_fp8: bool = Field(False, description="FP8 (needs TransformerEngine).")


class AlgorithmKeys(_Strict):
    algorithm: Literal["grpo", "rloo", "reinforce_pp", "dr_grpo", "cispo", "gspo", "sapo"] = Field(
        "grpo", description="RL algorithm."
    )
    number_of_minibatches: int = Field(
        1, ge=1, le=MAX_COUNT, description="Optimizer steps per training step."
    )
    use_ppo_clip: bool = Field(False, description="Use the PPO clipped surrogate as the policy loss.")
    ppo_clip_ref_logprobs: Literal["rollout", "batch"] = Field(
        "rollout", description="Ratio reference: rollout logprobs or the trainer's before the step."
    )
    clip_low: float = Field(0.4, ge=0, le=1, description="Ratio lower bound = 1 - clip_low.")
    clip_high: float = Field(0.5, ge=0, description="Ratio upper bound = 1 + clip_high.")
    clip_ratio_c: float | None = Field(None, description="Dual-clip constant (> 1).")
    sapo_tau_pos: float = Field(1.0, gt=0, description="SAPO temperature for positive advantages.")
    sapo_tau_neg: float = Field(1.05, gt=0, description="SAPO temperature for non-positive advantages.")
    dr_grpo_loss_agg_mode: Literal["token_mean", "token_sum_norm"] = Field(
        "token_mean", description="DR-GRPO aggregation."
    )
    advantage_norm: Literal["group", "batch"] = Field("group", description="Advantage normalization scope.")
    use_tis: bool = Field(False, description="Truncated importance sampling against the rollout policy.")
    tis_cap: float = Field(2.0, gt=0, description="Upper bound of the IS weight.")
    tis_logprob_clamp: float = Field(20.0, gt=0, description="Clamp of the log-ratio before exp.")
    tis_mode: Literal["truncate", "icepop"] = Field(
        "truncate", description="Clamp (truncate) or zero out (icepop) outside bounds."
    )
    tis_floor: float = Field(0.0, ge=0, description="Lower IS bound (icepop).")
    kl_penalty_tau: float = Field(0.0, ge=0, description="KL-to-rollout-policy penalty coefficient.")
    kl_estimator: Literal["k2", "k3"] = Field("k2", description="KL estimator.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    entropy_chunk_size: int = Field(
        1024, le=MAX_TOKENS, description="Token chunk for log-prob/entropy computation; <= 0 = unchunked."
    )
    seq_is_masking: bool = Field(False, description="Sequence-level importance-sampling rejection.")
    seq_is_mask_low: float = Field(0.8, gt=0, lt=1, description="Lower sequence IS bound.")
    seq_is_mask_high: float = Field(1.2, gt=1, description="Upper sequence IS bound.")


class RewardShapingKeys(_Strict):
    filter_overlong: bool = Field(False, description="Zero the loss mask of truncated samples.")
    overlong_penalty_factor: float = Field(0.0, ge=0, description="Soft overlong length penalty.")
    overlong_buffer_tokens: int = Field(
        256, ge=1, le=MAX_TOKENS, description="Width of the overlong penalty ramp."
    )
    filter_gibberish: bool = Field(
        False, description="Zero the mask of samples with rare tokens at very low logprob."
    )
    gibberish_token_threshold: int = Field(100000, ge=1, description='"Rare" = token id above this.')
    gibberish_logprob_offset: float = Field(
        2.0, gt=0, description="Flag if logprob < -ln(vocab_threshold) - offset."
    )
    filter_repetition: bool = Field(False, description="Zero the mask of highly compressible completions.")
    repetition_compression_threshold: float = Field(
        10.0, gt=1, description="zlib compression ratio threshold."
    )
    normalize_rewards_to_range: bool = Field(
        False,
        description="[refractor] Map each environment's rewards onto [0, 1] with its "
        "reward_min/reward_max before advantages (Telescope used the range only for UI colouring; "
        "see docs/config.md#deliberate-differences).",
    )


class WeightSyncKeys(_Strict):
    weight_broadcast_mode: Literal["flattened_bucket", "per_tensor"] = Field(
        "flattened_bucket", description="Broadcast layout."
    )
    weight_broadcast_bucket_mb: int = Field(256, ge=1, le=MAX_MIB, description="Bucket size in MiB.")
    weight_broadcast_cpu_staging: bool = Field(
        False, description="Stage gathered weights on CPU before broadcast."
    )
    weight_sync_gather_before_pause_mb: int = Field(
        4096,
        ge=0,
        le=MAX_MIB,
        description="[refractor] Gather up to this many MiB of the weight-update buckets on the trainer "
        "BEFORE pausing the inference servers (generation continues during the gather); the rest streams "
        "while paused. 0 = gather while paused.",
    )
    weight_sync_inflight_kv: Literal["recompute", "keep"] = Field(
        "recompute",
        description="[refractor] What requests in flight during a weight update do with the KV they "
        "already hold. recompute (exact): their KV is dropped and re-prefilled with the new weights, so "
        "every token after the switch comes from the new policy; costs one prefill of every running "
        "sequence per update. keep (Telescope's behaviour, PipelineRL-style): the old-weight KV stays, "
        "tokens after the switch come from new weights over old-weight KV (neither policy exactly); "
        "no re-prefill.",
    )
    weight_broadcast_pin_memory: bool = Field(True, description="Megatron only: pinned staging buffers.")
    weight_broadcast_free_grad_buffers: bool = Field(
        True, description="Megatron only: free grad buffers during sync."
    )


class PackingKeys(_Strict):
    seq_len: int = Field(
        4096,
        ge=1,
        le=MAX_TOKENS,
        description="Micro-batch capacity in tokens; longer samples are truncated (counted).",
    )
    pad_to_multiple_of: int = Field(
        64, ge=1, le=MAX_TOKENS, description="Pad each micro-batch to a multiple of this."
    )


class InferenceKeys(_Strict):
    inference_host: str = Field(
        "auto",
        description="Inference server bind address. auto: 127.0.0.1 on a one-node cluster, else the "
        "node's own address; 0.0.0.0 exposes the servers on every interface.",
    )
    inference_base_port: int = Field(
        8100, ge=1, le=65535, description="Fallback base port (servers pick free ports)."
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of each GPU's memory the inference engine takes for weights + KV cache. "
        "Default: 0.9, or 0.4 when colocated (the trainer rank on the same GPU gets the rest).",
    )
    kv_cache_memory_gb: float | None = Field(
        None,
        gt=0,
        le=MAX_GIB,
        description="[refractor] Explicit KV-cache budget in GiB (CPU engines; overrides "
        "gpu_memory_utilization).",
    )
    max_model_len: int = Field(
        4096, ge=1, le=MAX_TOKENS, description="Context length; also clamps max_tokens client-side."
    )
    max_num_seqs: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="Scheduler concurrency. null: the native engine runs every lane a server is given "
        "(max_concurrent_prompts_per_server x group_size); vLLM keeps its own default.",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_TOKENS,
        description="Per-step token budget; at least max_model_len for the native engine and vLLM on CPU, "
        "which prefill a whole prompt in one step.",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="[refractor] Prompts reuse the KV of the full blocks they share with earlier requests (a "
        "group's prompt is prefilled once, a conversation's next turn only past its last one); every "
        "weight update drops the cache.",
    )
    native_engine_process: bool = Field(
        False,
        description="[refractor] Native engine servers run the engine in a process of its own, apart from "
        "HTTP and tokenization (in one process they share one GIL).",
    )
    native_async_scheduling: bool = Field(
        True,
        description="[refractor] Native engine servers launch each decode step before recording the one "
        "before it, so the host's bookkeeping overlaps the GPU's work.",
    )
    vllm_scheduling_policy: Literal["priority", "fcfs"] = Field(
        "priority",
        description="priority: a rollout's later turns are served before waiting requests; fcfs: arrival "
        "order (every request has priority 0). Both engines.",
    )
    enable_thinking: bool = Field(False, description="Passed as enable_thinking to apply_chat_template.")
    chat_template: str | None = Field(None, description="Replaces the tokenizer's chat template.")
    group_size: int = Field(8, ge=1, le=MAX_COUNT, description="Samples per prompt.")
    temperature: float = Field(
        1.0, ge=0, description="Sampling temperature (the trainer divides logits by it too)."
    )
    max_tokens: int = Field(
        3700, ge=1, le=MAX_TOKENS, description="Generation cap per request (per turn in multi-turn)."
    )
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling.")
    interleaved_rollouts: bool = Field(
        True, description="Multi-turn prompts extend the previous turn's exact tokens."
    )


class CheckpointKeys(_Strict):
    checkpoint_every: int | bool = Field(
        False, description="Save every N steps and at the last step; false disables."
    )
    checkpoint_save_training_state: bool = Field(
        True, description="Save optimizer/scheduler/RNG/orchestrator state (resume) too."
    )
    resume_from_checkpoint: bool | int = Field(False, description="true = latest step_N; an int = that step.")
    checkpoint_dir: str | None = Field(None, description="Default <run_dir>/<run_name>/checkpoints.")
    checkpoint_keep_last: int | None = Field(None, ge=1, description="Keep the last N checkpoints.")
    checkpoint_keep_every: int | None = Field(
        None, ge=1, description="Also keep every checkpoint whose step is a multiple of N."
    )


class LoggingKeys(_Strict):
    use_wandb: bool = Field(
        True,
        description="Log to Weights & Biases (needs the wandb extra). The local run store is always written.",
    )
    wandb_project: str = Field("refractor", description="W&B project (env WANDB_PROJECT overrides).")
    wandb_run_name: str = Field("refractor_run", description="W&B run name (env WANDB_RUN_NAME overrides).")
    wandb_tags: list[str] = Field(default_factory=lambda: ["refractor"], description="W&B tags.")
    wandb_upload_code: bool = Field(
        True, description="With use_wandb: upload the code snapshot as code/source.zip + metadata.json."
    )
    wandb_upload_logs: bool = Field(
        True,
        description="With use_wandb: upload runs/<run>/logs/*.log as W&B run files at the end.",
    )
    wandb_upload_logs_detailed: bool = Field(False, description="Telescope only: detailed log upload.")
    wandb_upload_logs_stdout: bool = Field(False, description="Telescope only: stdout upload.")
    wandb_code_max_file_size_mb: float = Field(
        2.0, gt=0, description="Code snapshot in the run store: larger files are left out (and counted)."
    )
    wandb_code_exclude_patterns: list[str] = Field(
        default_factory=lambda: list(_WANDB_CODE_EXCLUDES),
        description="Code snapshot: glob patterns of names (or leading paths) of files and folders left out.",
    )
    record_telemetry: bool = Field(
        True,
        description="[refractor] false: the run store keeps only step metrics, rollouts and the run's "
        "state; no timeline, node, server or torch metrics, log lines or code snapshot (log files are "
        "still written). The dashboard's Timeline, Infra, Logs and Code pages are then empty.",
    )
    system_metrics_collection_interval_seconds: float = Field(
        1.0, gt=0, le=MAX_SECONDS, description="System metrics sampling period."
    )
    torch_memory_sample_interval_seconds: float = Field(
        0.1, gt=0, le=MAX_SECONDS, description="Trainer torch-memory sampling period (CUDA ranks)."
    )
    event_tail_window_seconds: int = Field(60, ge=1, description="Telescope only: W&B event tail window.")
    event_block_duration_seconds: int = Field(
        1800, ge=1, description="Telescope only: W&B event block length."
    )
    event_upload_interval_seconds: int = Field(
        5, ge=1, description="Telescope only: W&B event upload period."
    )
    metrics_logger_interval_seconds: float = Field(
        2.0, gt=0, le=MAX_SECONDS, description="Infra metrics poll period."
    )
    ray_torch_memory_drain_interval_seconds: float = Field(
        0.5,
        gt=0,
        le=MAX_SECONDS,
        description="How often the driver collects the ranks' torch-memory samples.",
    )
    rollout_block_size: int = Field(500, ge=1, description="Telescope only: steps per W&B rollout archive.")
    track_gpu_events: bool = Field(
        True,
        description="Record every trainer span (CUDA events on GPU); false: only the step, wall clock.",
    )


class EvalKeys(_Strict):
    eval_before_training: bool = Field(True, description="Baseline eval at step 0 (skipped on resume).")
    eval_after_training: bool = Field(True, description="Final eval.")
    eval_num_servers: int = Field(
        1, ge=0, le=MAX_WORKERS, description="Servers reserved for evals (from the end of the server list)."
    )
    eval_start_end_use_all_servers: bool = Field(True, description="Baseline/final evals use every server.")
    enable_vllm_tracing: bool = Field(
        True,
        description="vLLM servers export each request's span to a receiver in the driver, whose "
        "latency phases the rollout's generation spans carry (docs/metrics.md#latency).",
    )
    otlp_receiver_port: int = Field(
        4318,
        ge=1,
        le=65535,
        description="Port of the driver's OTLP/HTTP trace receiver (busy: a free one, logged).",
    )


SECTIONS: list[tuple[str, type[BaseModel]]] = [
    ("General / model", GeneralKeys),
    ("Ray cluster", RayKeys),
    ("Workers", WorkerKeys),
    ("Orchestrator", OrchestratorKeys),
    ("Trainer / optimizer / schedule", TrainerKeys),
    ("Megatron (train_backend: megatron; docs/megatron.md)", MegatronKeys),
    ("Algorithm / loss", AlgorithmKeys),
    ("Reward shaping and output filters", RewardShapingKeys),
    ("Weight sync", WeightSyncKeys),
    ("Sequence packing", PackingKeys),
    ("Inference server / sampling", InferenceKeys),
    ("Checkpointing", CheckpointKeys),
    ("Logging", LoggingKeys),
    ("Evals and tracing", EvalKeys),
]

# Keys accepted so Telescope YAMLs load unchanged, but which refractor does not act on.
IGNORED_KEYS: dict[str, str] = {
    "megatron_disable_unified_memory_jit": "refractor's Megatron trainer compiles no JIT kernels",
    "megatron_overlap_grad_reduce": "refractor's Megatron trainer reduces gradients once per minibatch, "
    "after its rows",
    "wandb_upload_logs_detailed": "the log files hold every line; wandb_upload_logs uploads them",
    "wandb_upload_logs_stdout": "the log files hold every line; wandb_upload_logs uploads them",
    "event_tail_window_seconds": "events go to the local run store, not W&B archives",
    "event_block_duration_seconds": "events go to the local run store, not W&B archives",
    "event_upload_interval_seconds": "events go to the local run store, not W&B archives",
    "rollout_block_size": "rollouts go to the local run store, not W&B archives",
    "megatron_global_batch_size": "unused in Telescope too",
    "inference_base_port": "each server listens on a free port the OS picks (the URLs are in the run "
    "store), so runs sharing a machine never collide",
    "weight_broadcast_pin_memory": "the Megatron trainer sends its export from the trainer's device",
    "weight_broadcast_free_grad_buffers": "gradients are always freed at the end of each step, before the "
    "weight update",
}

# Where a default differs from Telescope's on purpose (checked by the tests;
# docs/config.md#telescope-compatibility).
DELIBERATE_DEFAULT_CHANGES: dict[str, str] = {
    "inference_host": "servers listen on loopback (one node) or the node's address, never every interface",
    "ray_namespace": "named after this project instead of 'telescope'",
    "wandb_project": "named after this project",
    "wandb_run_name": "named after this project",
    "wandb_tags": "named after this project",
    "gpu_memory_utilization": "left unset: 0.9 as before, or 0.4 when servers and trainer ranks share GPUs",
}


class RefractorConfig(
    GeneralKeys,
    RayKeys,
    WorkerKeys,
    OrchestratorKeys,
    TrainerKeys,
    MegatronKeys,
    AlgorithmKeys,
    RewardShapingKeys,
    WeightSyncKeys,
    PackingKeys,
    InferenceKeys,
    CheckpointKeys,
    LoggingKeys,
    EvalKeys,
):
    """The resolved configuration of a run. Frozen; pass it (or the fields needed) explicitly."""

    _user_keys: frozenset[str] = PrivateAttr(default=frozenset())

    @model_validator(mode="before")
    @classmethod
    def _derived_defaults(cls, data: Any) -> Any:
        # free_lane_after_generation only works with individual lanes: when the user did not set
        # it, follow enable_individual_sample_lanes instead of failing a Telescope YAML.
        if (
            isinstance(data, dict)
            and "free_lane_after_generation" not in data
            and data.get("enable_individual_sample_lanes") is False
        ):
            data = {**data, "free_lane_after_generation": False}
        # sequence parallelism splits the sequence among tensor-parallel ranks; Telescope's default, true,
        # means "when it can run" (TP > 1); refractor turns it on only when the user sets it
        if isinstance(data, dict) and "megatron_sequence_parallel" not in data:
            data = {**data, "megatron_sequence_parallel": False}
        return data

    @model_validator(mode="after")
    def _cross_field_rules(self) -> RefractorConfig:
        errors = cross_field_errors(self)
        if errors:
            raise ValueError("\n".join(errors))
        return self

    # --- derived values (no state of their own) ---
    @property
    def num_inference_servers(self) -> int:
        return self.inference_num_workers // self.inference_tensor_parallel_size

    @property
    def lanes_per_server(self) -> int:
        """Completions the orchestrator keeps in flight on each server, training and evals alike."""
        return self.max_concurrent_prompts_per_server * self.group_size

    def sleeps_during_training(self, colocated: bool) -> bool:
        """``inference_sleep_during_training`` resolved for the run's placement."""
        if self.inference_sleep_during_training == "auto":
            return colocated and self.max_async_rollout == 0
        return self.inference_sleep_during_training

    def engine_memory_share(self, colocated: bool) -> float:
        """``gpu_memory_utilization`` resolved for the run's placement."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return COLOCATED_GPU_MEMORY_UTILIZATION if colocated else SPLIT_GPU_MEMORY_UTILIZATION

    @property
    def samples_per_step(self) -> int:
        return self.prompts_batch_size_for_trainer * self.group_size

    @property
    def user_keys(self) -> frozenset[str]:
        """Top-level keys set by the config file or the command line (the 'custom config')."""
        return self._user_keys


RAY_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


def _clipping_active(c: RefractorConfig) -> bool:
    return c.use_ppo_clip or c.algorithm in {"cispo", "gspo"}


# the Megatron trainer's options it does not build, each refused naming the key when set otherwise
_MEGATRON_UNBUILT = {
    "megatron_main_params_dtype": (
        "float32",
        "master weights are float32; Megatron-Core's float16 masters are TransformerEngine's per-tensor "
        "scaled copies, not built",
    ),
    "model_dtype": ("float32", "master weights are float32; mixed_precision_dtype sets the compute dtype"),
}


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# the precision-aware optimizer's dtype keys and the values each accepts (main params: _MEGATRON_UNBUILT)
_MEGATRON_DTYPE_KEYS = {
    "megatron_main_grads_dtype": ("float32", "bfloat16"),
    "megatron_main_params_dtype": ("float32", "float16"),
    "megatron_exp_avg_dtype": ("float32", "bfloat16", "float16"),
    "megatron_exp_avg_sq_dtype": ("float32", "bfloat16", "float16"),
}


def _megatron_optimizer_errors(c: RefractorConfig) -> list[str]:
    """The dtype keys: values, and set only with the precision-aware optimizer (as Megatron-Core)."""
    errors = []
    for key, accepted in _MEGATRON_DTYPE_KEYS.items():
        value = getattr(c, key)
        if value not in accepted:
            errors.append(f"`{key}: {value}`: expected one of {', '.join(accepted)}")
        elif value != "float32" and not c.megatron_use_precision_aware_optimizer:
            errors.append(
                f"`{key}: {value}` needs `megatron_use_precision_aware_optimizer: true` (without it "
                "master weights, gradients and AdamW moments are float32, as in Megatron-Core)"
            )
    if c.megatron_main_grads_dtype == "bfloat16" and c.mixed_precision_dtype != "bfloat16":
        errors.append(
            "`megatron_main_grads_dtype: bfloat16` keeps the gradients in the bf16 compute dtype: it needs "
            f"`mixed_precision_dtype: bfloat16` (not {c.mixed_precision_dtype})"
        )
    return errors


def _megatron_errors(c: RefractorConfig) -> list[str]:
    """The layout's broken rules, then what refractor's Megatron trainer does not run (docs/megatron.md):
    the Transformer Engine layer spec (so FP8), mixture-of-experts models other than Qwen3-MoE /
    Mixtral (or with TP but no sequence parallelism, or served by the native engine), and float16
    master weights."""
    sizes = ParallelSizes(
        tensor=c.megatron_tensor_parallel_size,
        pipeline=c.megatron_pipeline_parallel_size,
        context=c.megatron_context_parallel_size,
        expert=c.megatron_expert_parallel_size,
        sequence_parallel=c.megatron_sequence_parallel,
    )
    shape = read_model_shape(c.model)
    errors = layout_errors(
        sizes,
        c.trainer_num_workers,
        shape,
        use_transformer_engine=c.megatron_use_transformer_engine,
        fp8=c.megatron_fp8,
        transformer_engine_present=transformer_engine_installed(),
    )
    if c.megatron_use_transformer_engine and transformer_engine_installed():
        errors.append(
            "`megatron_use_transformer_engine: true`: refractor's Megatron trainer builds Megatron-Core's "
            "local layer spec only (the Transformer Engine spec, and with it FP8, is not built yet); set it "
            "to false"
        )
    if shape is not None and shape.moe_refusal:
        errors.append(shape.moe_refusal)
    elif shape is not None and shape.num_experts:
        if c.megatron_tensor_parallel_size > 1 and not c.megatron_sequence_parallel:
            errors.append(MOE_TENSOR_PARALLEL)
        if c.inference_engine == "native":
            errors.append(
                "`inference_engine: native`: refractor's engine has no mixture-of-experts layers; serve "
                "this model with `inference_engine: vllm` (or auto)"
            )
    errors += _megatron_optimizer_errors(c)
    for key, (supported, reason) in _MEGATRON_UNBUILT.items():
        if getattr(c, key) != supported:
            errors.append(
                f"`{key}: {_yaml(getattr(c, key))}` is not supported by refractor's Megatron trainer "
                f"({reason}); set it to {_yaml(supported)}"
            )
    if c.fsdp_cpu_offload:
        errors.append("`fsdp_cpu_offload: true` needs `train_backend: fsdp`")
    return errors


def cross_field_errors(c: RefractorConfig) -> list[str]:
    """Every rule that involves more than one key; each message names the keys and the fix."""
    e: list[str] = []
    for key in ("ray_inference_resources", "ray_trainer_resources"):
        for resource, amount in getattr(c, key).items():
            if resource in RAY_BUILTIN_RESOURCES or resource.startswith("node:"):
                e.append(
                    f"`{key}` names {resource!r}, which Ray accounts itself: list only custom resources "
                    "(set CPUs with `ray_inference_cpus_per_worker` / `ray_trainer_cpus_per_worker`)"
                )
            elif not 0 < amount <= MAX_CPUS:
                e.append(f"`{key}`: {resource!r} must be in (0, {MAX_CPUS:g}], not {amount:g}")
    if c.inference_sleep_during_training is True and c.max_async_rollout > 0:
        e.append(
            f"`inference_sleep_during_training: true` needs `max_async_rollout: 0`: with "
            f"{c.max_async_rollout}, generation goes on while the trainer steps and a sleeping server "
            "would stall it"
        )
    if not c.environments:
        e.append("`environments` must list at least one environment, e.g. environments: [{name: countdown}]")
    if c.use_tis and c.use_ppo_clip and c.ppo_clip_ref_logprobs == "rollout":
        e.append(
            "`use_tis` with `use_ppo_clip` and `ppo_clip_ref_logprobs: rollout` applies the rollout "
            "correction twice; set `ppo_clip_ref_logprobs: batch`"
        )
    if c.use_ppo_clip and c.algorithm in {"cispo", "gspo", "sapo"}:
        e.append(
            f"`use_ppo_clip` cannot be combined with `algorithm: {c.algorithm}` "
            "(it has its own clipping/gating)"
        )
    if c.clip_ratio_c is not None:
        if c.clip_ratio_c <= 1.0:
            e.append(f"`clip_ratio_c` = {c.clip_ratio_c} must be > 1.0")
        if not _clipping_active(c):
            e.append(
                "`clip_ratio_c` (dual clip) needs clipping: set `use_ppo_clip: true` or use "
                "`algorithm: cispo|gspo`"
            )
    if c.advantage_norm == "batch" and c.algorithm in {"rloo", "dr_grpo"}:
        e.append(f"`advantage_norm: batch` is not valid with `algorithm: {c.algorithm}` (use `group`)")
    if c.advantage_norm == "group" and c.algorithm == "reinforce_pp":
        e.append("`algorithm: reinforce_pp` requires `advantage_norm: batch`")
    if c.inference_num_workers % c.inference_tensor_parallel_size:
        e.append(
            f"`inference_num_workers` ({c.inference_num_workers}) must be a multiple of "
            f"`inference_tensor_parallel_size` ({c.inference_tensor_parallel_size})"
        )
    if c.fsdp_context_parallel_size > 1:
        if c.train_backend != "fsdp":
            e.append("`fsdp_context_parallel_size` > 1 needs `train_backend: fsdp`")
        if c.seq_len % (2 * c.fsdp_context_parallel_size):
            e.append(
                f"`seq_len` ({c.seq_len}) must be divisible by 2 x `fsdp_context_parallel_size` "
                f"({2 * c.fsdp_context_parallel_size})"
            )
        if c.trainer_num_workers % c.fsdp_context_parallel_size:
            e.append(
                f"`trainer_num_workers` ({c.trainer_num_workers}) must be a multiple of "
                f"`fsdp_context_parallel_size` ({c.fsdp_context_parallel_size})"
            )
    if c.fp8:
        if c.train_backend != "fsdp":
            e.append("`fp8: true` needs `train_backend: fsdp` (Megatron has `megatron_fp8`)")
        # float8 GEMMs need token counts (the weight gradient's inner dimension) in multiples of 16,
        # on every context-parallel rank's share of a pass too
        align = 16 * c.fsdp_context_parallel_size
        for key in ("pad_to_multiple_of", "trainer_pass_pad_multiple"):
            if getattr(c, key) % align:
                e.append(
                    f"`fp8: true` needs `{key}` ({getattr(c, key)}) to be a multiple of {align} "
                    "(16 x `fsdp_context_parallel_size`): float8 GEMMs take token counts in multiples of 16"
                )
    if c.lora_rank:
        unknown = sorted(set(c.lora_target_modules) - set(LORA_PROJECTIONS))
        if unknown or not c.lora_target_modules:
            e.append(
                f"`lora_target_modules` must name some of {', '.join(LORA_PROJECTIONS)}; got "
                f"{', '.join(unknown) or 'none'}"
            )
        if c.train_backend != "fsdp":
            e.append("`lora_rank` > 0 needs `train_backend: fsdp`")
        if c.fp8:
            e.append(
                "`fp8: true` with `lora_rank` > 0 is not supported (the adapted projections would stay bf16)"
            )
    unknown_saved = sorted(set(c.lora_modules_to_save) - set(LORA_MODULES_TO_SAVE))
    if unknown_saved:
        e.append(
            f"`lora_modules_to_save` must name some of {', '.join(LORA_MODULES_TO_SAVE)}; got "
            f"{', '.join(unknown_saved)}"
        )
    if c.lora_modules_to_save and not c.lora_rank:
        e.append("`lora_modules_to_save` needs `lora_rank` > 0 (without adapters the whole model trains)")
    if c.lora_sync == "adapter":
        if not c.lora_rank:
            e.append("`lora_sync: adapter` needs `lora_rank` > 0 (there are no adapters to push)")
        if c.inference_engine == "vllm" and c.lora_rank > VLLM_MAX_LORA_RANK:
            e.append(
                f"`lora_sync: adapter` with vLLM: `lora_rank` ({c.lora_rank}) is above the largest LoRA rank "
                f"vLLM serves ({VLLM_MAX_LORA_RANK}); use `lora_sync: merged` or `inference_engine: native`"
            )
        if c.inference_sleep_level == 2 and c.inference_sleep_during_training is not False:
            e.append(
                "`lora_sync: adapter` with `inference_sleep_level: 2`: sleeping servers would discard the "
                "base weights and an adapter push does not refill them; use `inference_sleep_level: 1`"
            )
    # Rules Telescope left unchecked (docs/config.md#validation).
    if c.train_backend == "megatron":
        e += _megatron_errors(c)
    if (
        c.evals
        and c.eval_num_servers >= c.num_inference_servers
        and c.inference_num_workers % c.inference_tensor_parallel_size == 0
    ):
        e.append(
            f"`eval_num_servers` ({c.eval_num_servers}) must leave at least one of the "
            f"{c.num_inference_servers} inference server(s) for training; lower it or raise "
            "`inference_num_workers`"
        )
    if c.free_lane_after_generation and not c.enable_individual_sample_lanes:
        e.append("`free_lane_after_generation: true` needs `enable_individual_sample_lanes: true`")
    if c.max_tokens >= c.max_model_len:
        e.append(
            f"`max_tokens` ({c.max_tokens}) must be below `max_model_len` ({c.max_model_len}) "
            "to leave room for the prompt"
        )
    if c.pad_to_multiple_of > c.seq_len:
        e.append(f"`pad_to_multiple_of` ({c.pad_to_multiple_of}) cannot exceed `seq_len` ({c.seq_len})")
    if c.use_tis and c.tis_mode == "icepop" and c.tis_floor >= c.tis_cap:
        e.append(f"`tis_floor` ({c.tis_floor}) must be below `tis_cap` ({c.tis_cap})")
    if c.inference_engine == "native" and c.inference_tensor_parallel_size > 1:
        e.append(
            "the native engine has no tensor parallelism: set `inference_tensor_parallel_size: 1` "
            "or `inference_engine: vllm`"
        )
    if not isinstance(c.checkpoint_every, bool) and c.checkpoint_every < 1:
        e.append(f"`checkpoint_every` ({c.checkpoint_every}) must be >= 1, or false to disable")
    if not isinstance(c.resume_from_checkpoint, bool) and c.resume_from_checkpoint < 0:
        e.append(f"`resume_from_checkpoint` ({c.resume_from_checkpoint}) must be true, false or a step >= 0")
    if c.number_of_minibatches > c.samples_per_step:
        e.append(
            f"`number_of_minibatches` ({c.number_of_minibatches}) exceeds the samples per step "
            f"({c.samples_per_step} = prompts_batch_size_for_trainer x group_size)"
        )
    if c.deterministic_rollouts and c.evals and c.eval_num_servers > 0:
        e.append(
            f"`deterministic_rollouts` cannot be combined with `eval_num_servers: {c.eval_num_servers}`: "
            "eval servers hold other weights and drain training requests at eval steps; "
            "set `eval_num_servers: 0`"
        )
    names = [ev.name for ev in c.evals]
    if len(names) != len(set(names)):
        e.append(f"`evals` names must be unique, got {names}")
    from refractor.evals.passk import parse_pass_k

    for ev in c.evals:
        try:
            parse_pass_k(ev.pass_k, f"`evals` entry {ev.name!r}: pass_k")
        except ValueError as err:
            e.append(str(err))
    return e
