"""refractor's embedded inference engine (nano-vllm shaped).

``LLMEngine`` (sync core: scheduler -> model runner -> sampler) and ``AsyncLLMEngine`` (the
same engine driven by one background thread, for the HTTP server). Continuous batching, priority
scheduling, processed log-probs, weight versions, in-place weight updates.

KV cache: paged (fixed-size blocks + per-sequence block tables, allocated once from the memory
budget), without prefix caching. A prefill always starts at position 0, so preempted sequences
and sequences whose weights changed under them are recomputed exactly. Decode on CUDA: CUDA
graphs per padded batch size, a Triton paged-attention kernel, torch.compile-fused elementwise
ops; elsewhere: eager, gather + SDPA. The decoder is ``refractor.models`` (shared with the trainer).
"""

from refractor.inference.engine.config import EngineConfig
from refractor.inference.engine.llm_engine import EngineStats, LLMEngine, PromptTooLongError
from refractor.inference.engine.sampler import process_logits
from refractor.inference.engine.sampling_params import SamplingParams
from refractor.inference.engine.sequence import CompletionOutput, RequestOutput, WeightVersionSpan

__all__ = [
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "PromptTooLongError",
    "RequestOutput",
    "SamplingParams",
    "WeightVersionSpan",
    "process_logits",
]
