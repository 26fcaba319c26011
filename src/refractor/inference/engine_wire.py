"""What the server and its engine process send each other (``engine_process``, ``engine_core``).

Every message is a msgpack list (never pickle). Server -> engine:
``["generate", rid, prompt_ids, params, priority]``, ``["cancel", rid]``,
``["call", call_id, op, args]``. Engine -> server: ``["ready", EngineInfo]``, ``["failed", message]``,
``["output", rid, output, status]``, ``["request_error", rid, kind, message]``,
``["reply", call_id, result, status]``, ``["call_error", call_id, kind, message, http_status, status]``,
``["status", status]`` (periodic: the engine's counters for ``/metrics``). Errors travel as their
type's name, message and HTTP status, and are raised again on the server as the same type.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from http import HTTPStatus

import msgpack

from refractor.inference.engine.async_engine import EngineDeadError, RequestFailedError
from refractor.inference.engine.llm_engine import EngineStats, SleepModeOffError
from refractor.inference.engine.sequence import CompletionOutput, RequestOutput, WeightVersionSpan


@dataclass(frozen=True)
class EngineStatus:
    """What the server answers from without asking the engine process: its state and counters."""

    is_paused: bool
    is_sleeping: bool
    stats: EngineStats
    memory_gb: dict[str, float] | None  # the allocator's figures; None: not read this time

    def encode(self) -> list:
        return [self.is_paused, self.is_sleeping, list(astuple(self.stats)), self.memory_gb]

    @classmethod
    def decode(cls, fields: list) -> EngineStatus:
        paused, sleeping, stats, memory = fields
        return cls(paused, sleeping, EngineStats(*stats), memory)


@dataclass(frozen=True)
class EngineInfo:
    """What the engine process reports once its engine is built (the ``ready`` message)."""

    pid: int
    device: str
    max_model_len: int
    vocab_size: int
    startup_s: dict[str, float]  # the engine's start-up phases
    status: EngineStatus

    def encode(self) -> list:
        return [
            self.pid,
            self.device,
            self.max_model_len,
            self.vocab_size,
            self.startup_s,
            self.status.encode(),
        ]

    @classmethod
    def decode(cls, fields: list) -> EngineInfo:
        *head, status = fields
        return cls(*head, EngineStatus.decode(status))


def pack(message: list) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> list:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


def encode_output(out: RequestOutput) -> list:
    completions = [
        [
            c.index,
            c.token_ids,
            c.logprobs,
            c.finish_reason,
            c.stop_reason,
            [[s.version, s.start, s.end] for s in c.weight_versions],
            c.ranks,
            c.top_logprobs,
        ]
        for c in out.outputs
    ]
    return [
        out.request_id,
        out.prompt_token_ids,
        completions,
        out.arrival_time,
        out.first_token_time,
        out.finish_time,
        out.error,
        out.scheduled_time,
    ]


def decode_output(fields: list) -> RequestOutput:
    rid, prompt, completions, arrival, first_token, finish, error, scheduled = fields
    outputs = [
        CompletionOutput(
            index,
            token_ids,
            logprobs,
            finish_reason,
            stop_reason,
            [WeightVersionSpan(*span) for span in spans],
            ranks,
            [[tuple(pair) for pair in position] for position in top],
        )
        for index, token_ids, logprobs, finish_reason, stop_reason, spans, ranks, top in completions
    ]
    return RequestOutput(rid, prompt, outputs, arrival, first_token, finish, error, scheduled)


def error_fields(err: BaseException) -> tuple[str, str, int]:
    """(kind, message, HTTP status) of an exception raised where the engine is."""
    from fastapi import HTTPException

    from refractor.inference.server_state import BadRequest

    if isinstance(err, BadRequest):
        return "BadRequest", str(err), int(err.status)
    if isinstance(err, HTTPException):
        return "HTTPException", str(err.detail), err.status_code
    return type(err).__name__, str(err), int(HTTPStatus.INTERNAL_SERVER_ERROR)


def rebuild_error(kind: str, message: str, status: int = 500) -> BaseException:
    """The server-side exception of the same type, so routes handle it as they would in-process."""
    import torch
    from fastapi import HTTPException

    from refractor.inference.server_state import BadRequest

    if kind == "BadRequest":
        return BadRequest(message, HTTPStatus(status))
    if kind == "HTTPException":
        return HTTPException(status, message)
    known = {
        "ValueError": ValueError,
        "EngineDeadError": EngineDeadError,
        "RequestFailedError": RequestFailedError,
        "SleepModeOffError": SleepModeOffError,
        "OutOfMemoryError": torch.OutOfMemoryError,
    }
    cls = known.get(kind)
    return cls(message) if cls else RuntimeError(f"{kind} in the engine process: {message}")
