"""Engine settings (built once from the resolved refractor config by the server launcher)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refractor.models.lora import ALL_PROJECTIONS


@dataclass(frozen=True)
class EngineConfig:
    """How the native engine sizes itself.

    KV cache: on CUDA the cache takes ``gpu_memory_utilization`` of the device memory minus the
    weights and the peak activation of the largest step; elsewhere (and whenever it is set)
    ``kv_cache_memory_gb`` is the budget. Either way it is allocated once, at start-up.
    """

    max_model_len: int = 4096
    max_num_seqs: int = 256
    # prefill token budget per step; default max(max_model_len, 8192)
    max_num_batched_tokens: int | None = None
    block_size: int = 32
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"  # auto: the checkpoint's dtype on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when available
    enforce_eager: bool = False  # no CUDA graphs for decode
    compile_ops: bool = True  # CUDA only: fuse the decoder's elementwise glue with torch.compile
    # one GEMM for q/k/v and one for gate/up in every layer; HF names still address each part
    # (bench_engine.py --compare-fused-projections measures it against separate GEMMs)
    fuse_projections: bool = True
    # weights and KV cache in memory that sleep() gives back (engine/sleep.py); off: plain tensors
    enable_sleep_mode: bool = False
    # prompts reuse the cached KV of full blocks they share with earlier sequences (block_manager.py)
    enable_prefix_caching: bool = True
    # while sequences decode, newcomers wait this many decode steps (or until they fill the
    # prefill token budget) and are then prefilled together (0: each at once); fewer, larger
    # prefills keep the decode steps going at the cost of a few steps of time to first token
    decode_steps_between_prefills: int = 32
    # and at most this long (whichever comes first): slow steps, as with a trainer sharing the GPU,
    # would otherwise stretch 32 steps to a second of waiting
    max_prefill_delay_ms: float = 100.0
    # the host schedules and launches decode step N+1 while the device runs step N, recording
    # step N's tokens after (a sequence that finished at N computes one spare token); off: the
    # host waits for each step's tokens before it prepares the next
    async_scheduling: bool = True
    seed: int = 0
    # runtime LoRA (engine/lora.py): adapter buffers of this rank on these projections, allocated at
    # load and filled by adapter weight updates (lora_sync: adapter); 0: none, no extra work
    lora_rank: int = 0
    lora_target_modules: tuple[str, ...] = ALL_PROJECTIONS

    def __post_init__(self) -> None:
        for key in ("max_model_len", "max_num_seqs", "block_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"EngineConfig.{key} must be >= 1, got {getattr(self, key)}")
        if self.decode_steps_between_prefills < 0:
            steps = self.decode_steps_between_prefills
            raise ValueError(f"EngineConfig.decode_steps_between_prefills must be >= 0, got {steps}")
        if not self.max_prefill_delay_ms >= 0:
            raise ValueError(
                f"EngineConfig.max_prefill_delay_ms must be >= 0, got {self.max_prefill_delay_ms}"
            )
        if self.lora_rank < 0:
            raise ValueError(f"EngineConfig.lora_rank must be >= 0, got {self.lora_rank}")
        unknown = sorted(set(self.lora_target_modules) - set(ALL_PROJECTIONS))
        if unknown or (self.lora_rank and not self.lora_target_modules):
            raise ValueError(
                f"EngineConfig.lora_target_modules must name some of {', '.join(ALL_PROJECTIONS)}; got "
                f"{', '.join(self.lora_target_modules) or 'none'}"
            )
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}): a whole prompt is prefilled in one step"
            )

    @property
    def prefill_token_budget(self) -> int:
        return self.max_num_batched_tokens or max(self.max_model_len, 8192)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if device.type != "cuda":
            return torch.float32
        dtype = getattr(torch, checkpoint_dtype or "bfloat16", torch.bfloat16)
        return torch.bfloat16 if dtype == torch.float32 else dtype
