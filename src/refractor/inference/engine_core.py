"""The engine process's side of ``refractor serve --engine-process`` (``engine_process`` is the
server's): build the engine, then serve requests, control calls and the weight-transfer routes'
work (``WeightTransfer`` runs here, where the weights, NCCL groups and CUDA IPC handles are) until
the server goes away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from refractor.inference.engine import LLMEngine
from refractor.inference.engine.sampling_params import SamplingParams
from refractor.inference.engine.sequence import RequestOutput
from refractor.inference.engine_wire import (
    EngineInfo,
    EngineStatus,
    encode_output,
    error_fields,
    pack,
    unpack,
)

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 0.25


def load_engine(model_path: str | Path, config: Any, tokenizer: Any) -> LLMEngine:
    """The native engine of a server, in either layout: it decodes with ``tokenizer`` (for stop
    strings) and also stops at the tokenizer's EOS token."""
    core = LLMEngine.from_pretrained(model_path, config, detokenize=tokenizer.decode)
    if tokenizer.eos_token_id is not None:
        core.eos_token_ids |= {tokenizer.eos_token_id}
    return core


def engine_main(
    model_path: str, config: Any, inbox: str, outbox: str, parent_pid: int, log_level: str = "WARNING"
) -> None:
    """The engine process: build the engine, then serve the server's messages until it goes away."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(outbox)
    try:
        asyncio.run(_serve(model_path, config, ctx, push, inbox, parent_pid))
    finally:
        ctx.destroy(linger=1000)


async def _serve(
    model_path: str,
    config: Any,
    ctx: zmq.asyncio.Context,
    push: zmq.asyncio.Socket,
    inbox: str,
    parent_pid: int,
) -> None:
    try:
        from transformers import AutoTokenizer

        from refractor.inference.engine.async_engine import AsyncLLMEngine
        from refractor.inference.request_schemas import InitInfo
        from refractor.inference.weight_routes import WeightTransfer

        core = load_engine(model_path, config, AutoTokenizer.from_pretrained(model_path))
    except Exception as err:  # noqa: BLE001 - reported to the server, which exits with it
        log.exception("the engine could not be built")
        await push.send(pack(["failed", f"{type(err).__name__}: {err}"]))
        return
    engine = AsyncLLMEngine(core)
    transfer = WeightTransfer(engine)

    def snapshot(memory: bool = False) -> EngineStatus:
        # the allocator's figures only in the periodic report: torch.cuda.memory_stats builds a large
        # dict under the GIL the engine thread needs between its kernel launches
        figures = engine.memory_gb() if memory else None
        return EngineStatus(engine.is_paused, engine.is_sleeping, engine.stats(), figures)

    def status(memory: bool = False) -> list:
        return snapshot(memory).encode()

    info = EngineInfo(
        os.getpid(),
        str(core.device),
        core.config.max_model_len,
        core.model.config.vocab_size,
        dict(core.runner.startup_s),
        snapshot(memory=True),
    )
    await push.send(pack(["ready", info.encode()]))
    ops = {
        "abort": engine.abort,
        "pause": engine.pause,
        "resume": engine.resume,
        "sleep": engine.sleep,
        "wake_up": engine.wake_up,
        "reset_prefix_cache": transfer.reset_prefix_cache,
        "weight_info": transfer.weight_info,
        "init": lambda info: transfer.init(InitInfo.model_validate(info)),
        "shutdown": transfer.shutdown,
        "start": transfer.start,
        "update": transfer.update,
        "finish": transfer.finish,
    }
    requests: dict[str, asyncio.Task] = {}
    pending_partials: list[asyncio.Future] = []  # sends in flight (kept referenced until done)

    def send_partial(rid: str, out: RequestOutput) -> None:  # on this loop, in step order
        pending_partials.append(asyncio.ensure_future(push.send(pack(["partial", rid, encode_output(out)]))))
        pending_partials[:] = [p for p in pending_partials if not p.done()]

    async def run_request(rid: str, prompt: list[int], params: dict, priority: int, stream: bool) -> None:
        try:
            on_partial = (lambda out: send_partial(rid, out)) if stream else None
            out = await engine.generate(
                prompt, SamplingParams(**params), rid, priority, on_partial=on_partial
            )
            await push.send(pack(["output", rid, encode_output(out), status()]))
        except asyncio.CancelledError:
            pass  # the server stopped waiting (its client went away); the engine aborted the request
        except Exception as err:  # noqa: BLE001 - every failure goes back to that request alone
            kind, message, _ = error_fields(err)
            await push.send(pack(["request_error", rid, kind, message]))
        finally:
            requests.pop(rid, None)

    async def run_call(call_id: int, op: str, args: dict) -> None:
        try:
            result = await ops[op](**args)
        except Exception as err:  # noqa: BLE001 - the caller gets it, with its HTTP status
            await push.send(pack(["call_error", call_id, *error_fields(err), status()]))
        else:
            await push.send(pack(["reply", call_id, result, status()]))

    async def report() -> None:
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            if os.getppid() != parent_pid:  # the server is gone: nobody can reach this engine
                log.error("the server process %d exited; the engine process stops", parent_pid)
                os._exit(1)
            await push.send(pack(["status", status(memory=True)]))

    pull = ctx.socket(zmq.PULL)
    pull.connect(inbox)
    reporter = asyncio.create_task(report())
    calls: set[asyncio.Task] = set()
    try:
        while True:
            message = unpack(await pull.recv())
            kind = message[0]
            if kind == "generate":
                _, rid, prompt, params, priority, stream = message
                requests[rid] = asyncio.create_task(run_request(rid, prompt, params, priority, stream))
            elif kind == "cancel":
                task = requests.get(message[1])
                if task is not None:
                    task.cancel()
            elif kind == "call":
                task = asyncio.create_task(run_call(message[1], message[2], message[3]))
                calls.add(task)
                task.add_done_callback(calls.discard)
    finally:
        reporter.cancel()
        with contextlib.suppress(Exception):
            engine.shutdown()
