"""One sampled continuation (a ``Sequence``) and what a finished request returns."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from refractor.inference.engine.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class WeightVersionSpan:
    """Output tokens ``[start, end)`` were sampled with the weights of ``version`` (vLLM's shape)."""

    version: int | str
    start: int
    end: int


class Sequence:
    """Prompt + generated tokens of one sample, its KV blocks and its per-token records."""

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        arrival: int,
        max_tokens: int,
        generator: torch.Generator | None,
        sample_seed: int = 0,
    ):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.arrival = arrival
        self.max_tokens = max_tokens
        self.generator = generator  # the torch sampling path's stream (seeded requests only)
        self.sample_seed = sample_seed  # the fused sampler's key: the request's seed, or a random one
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.table_version = 0  # bumped by the block manager whenever block_table changes
        self.block_row: np.ndarray | None = None  # the model runner's padded copy of block_table
        self.block_row_version = -1
        self.block_hashes: list[bytes] = []  # chained hashes of its full blocks (block_manager.py)
        self.num_computed_tokens = 0  # tokens whose KV the cache held when it was admitted
        self.kv_epoch = -1  # the block manager's epoch its KV was computed in
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.version_spans: list[WeightVersionSpan] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.scheduled_time: float | None = None  # time.monotonic() it first ran (its queue time ended)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: lower priority value first, then arrival (vLLM's priority policy)."""
        return (self.priority, self.arrival)

    def append(
        self,
        token_id: int,
        logprob: float,
        version: int | str,
        rank: int | None = None,
        top: list[tuple[int, float]] | None = None,
    ) -> None:
        position = self.num_output_tokens
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        if rank is not None:
            self.ranks.append(rank)
        if top is not None:
            self.top_logprobs.append(top)
        spans = self.version_spans
        if spans and spans[-1].version == version:
            spans[-1].end = position + 1
        else:
            spans.append(WeightVersionSpan(version, position, position + 1))

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[float]  # processed log-prob of each sampled token
    # stop | length | abort | error (its request failed in an engine step); None in a partial output
    # of a sequence still running (a streamed request's progress)
    finish_reason: str | None
    stop_reason: int | str | None
    weight_versions: list[WeightVersionSpan]
    ranks: list[int] = field(default_factory=list)  # present when the request asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @classmethod
    def from_sequence(cls, seq: Sequence, partial: bool = False) -> CompletionOutput:
        """The sequence's output; ``partial``: so far, with no finish reason while it runs."""
        return cls(
            seq.index,
            seq.output_token_ids,
            list(seq.logprobs),
            seq.finish_reason if partial else seq.finish_reason or "abort",
            seq.stop_reason,
            [WeightVersionSpan(s.version, s.start, s.end) for s in seq.version_spans],
            list(seq.ranks),
            list(seq.top_logprobs),
        )


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    arrival_time: float
    first_token_time: float | None
    finish_time: float = field(default_factory=time.monotonic)
    error: str | None = None  # why the request failed in an engine step (its completions end in "error")
    scheduled_time: float | None = None  # its first sequence first ran (None: it never did)

    def latency(self) -> dict[str, float]:
        """Seconds (time.monotonic differences): ``queue_time`` (arrival -> first scheduled),
        ``ttft`` (arrival -> first token), ``prefill_time`` (first scheduled -> first token),
        ``decode_time`` (first token -> finish), ``e2e_latency`` (arrival -> finish). A phase the
        request never reached is left out."""
        out = {"e2e_latency": self.finish_time - self.arrival_time}
        if self.scheduled_time is not None:
            out["queue_time"] = self.scheduled_time - self.arrival_time
        if self.first_token_time is not None:
            out["ttft"] = self.first_token_time - self.arrival_time
            out["decode_time"] = self.finish_time - self.first_token_time
            if self.scheduled_time is not None:
                out["prefill_time"] = self.first_token_time - self.scheduled_time
        return out

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
