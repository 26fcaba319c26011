"""Per-request sampling settings (the subset of vLLM's ``SamplingParams`` refractor relies on)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_N = 256
MAX_TOP_K = 2**31 - 1  # sampled in int32/int64 tensors; a top_k at or above the vocabulary is off
MAX_TOKENS = 2**31 - 1
MAX_STOP = 1024
MAX_STOP_CHARS = 1024
# Below this, logits / temperature leaves float32's range (NaN log-probs, or a temperature that
# rounds to 0 and samples at 1); a temperature this small is greedy in all but name.
MIN_TEMPERATURE = 1e-6


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    max_tokens: int | None = 16  # None = up to max_model_len
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # None: no top alternatives; k: also return the top-k processed logprobs

    def __post_init__(self) -> None:
        # Every value is checked here, before the request joins a batch: one that fails later, inside
        # an engine step, would fail every request of that step.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        errors = []
        if not 1 <= self.n <= MAX_N:
            errors.append(f"n must be between 1 and {MAX_N}, got {self.n}")
        usable = self.temperature == 0 or self.temperature >= MIN_TEMPERATURE  # False for NaN
        if not (math.isfinite(self.temperature) and usable):
            errors.append(
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                f"got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:  # also false for NaN
            errors.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= MAX_TOP_K:
            errors.append(f"top_k must be -1 or 0 (off) or between 1 and {MAX_TOP_K}, got {self.top_k}")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= MAX_TOKENS:
            errors.append(f"max_tokens must be between 1 and {MAX_TOKENS}, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            errors.append(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            errors.append(f"seed must fit in 64 bits (-2**63 <= seed < 2**63), got {self.seed}")
        if len(self.stop) > MAX_STOP or any(not isinstance(t, str) or not t for t in self.stop):
            errors.append(f"stop must be at most {MAX_STOP} non-empty strings")
        elif any(len(t) > MAX_STOP_CHARS for t in self.stop):
            errors.append(f"each stop string must be at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP or any(not 0 <= t < 2**31 for t in self.stop_token_ids):
            errors.append(f"stop_token_ids must be at most {MAX_STOP} token ids >= 0")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
