"""The weight-update routes of the native server, with vLLM 0.32's names and semantics.

``weight_update_router(WeightTransfer(engine))`` gives the native server the control plane a stock
vLLM server has in dev mode (``refractor.weight_sync.control_plane`` calls it), so one trainer-side
``WeightSender`` updates both engines: ``/get_world_size``, ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/weight_info``,
``/reset_prefix_cache``, ``/shutdown_weight_transfer_engine``. ``/pause``, ``/resume`` and
``/is_paused`` belong to the server itself (``refractor.inference.server``). The data plane is
the same code vLLM workers run (``refractor.weight_sync.data_plane.BucketReceiver``); the engine
only has to offer ``update_weights(named_tensors, version)``, ``weight_version``,
``named_parameters()`` and ``update_names(adapters)`` (sync or async). Blocking work (rendezvous,
receiving) runs in threads so the server keeps answering ``/health`` meanwhile.

An update holds the model's weights or, with ``lora_sync: adapter``, LoRA adapters and their scale
(``refractor.inference.engine.lora``); the coverage the canary checks is counted against the names a
complete update of that kind writes.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from http import HTTPStatus
from typing import Any

import torch
from fastapi import APIRouter, Body, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from refractor.errors import one_line
from refractor.inference.request_schemas import InitInfo, UpdateInfo, UpdateWeightsBody
from refractor.inference.server_state import BadRequest, invalid_request
from refractor.models.lora import is_adapter_update_name
from refractor.weight_sync.data_plane import BucketReceiver, MalformedStream
from refractor.weight_sync.process_group import (
    CollectiveTimeout,
    TransferGroup,
    check_worker_device,
    check_worker_join,
)


async def _call(fn, *args, **kwargs) -> Any:
    """Await an async engine method; run a sync one in a thread (it may block, e.g. on a weight copy)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.to_thread(fn, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


class WeightTransfer:
    """The weight-update control plane on the process that holds the engine's weights.

    Each route of ``weight_update_router`` is one method here, so the routes run the same code in
    the server's own process (engine thread) and in a separate engine process, where the server
    forwards them (``refractor.inference.engine_process``). Errors are ``BadRequest`` (the caller's
    fault) or ``HTTPException`` (the server's), both carrying their HTTP status.
    """

    def __init__(self, engine):
        self.engine = engine
        self.receivers: dict[str, BucketReceiver] = {}
        self.update_active = False

    def engine_device(self) -> torch.device:
        for _, param in self.engine.named_parameters():
            return param.device
        return torch.device("cpu")

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> dict:
        # running requests recompute their KV with the new weights only when asked (vLLM's
        # semantics), else they keep the KV they hold
        await _call(self.engine.reset_prefix_cache, reset_running_requests)
        return {"success": True}

    async def weight_info(self) -> dict:
        version = self.engine.weight_version
        return {"weight_version": None if version is None else str(version)}

    async def init(self, info: InitInfo) -> dict:
        device = self.engine_device()
        try:
            check_worker_join(info.rank_offset, info.world_size, info.master_port, info.backend)
            check_worker_device(info.backend, info.payload, device)
        except ValueError as err:
            raise BadRequest(f"invalid init_info: {err}") from None

        def join() -> TransferGroup:
            return TransferGroup.create(
                master_address=info.master_address,
                master_port=info.master_port,
                rank=info.rank_offset,
                world_size=info.world_size,
                backend=info.backend,
                group_name=info.group,
                device=device if info.backend == "nccl" else None,
                init_timeout_s=info.init_timeout_s,
                timeout_s=info.timeout_s,
            )

        try:
            group = await asyncio.to_thread(join)
        except Exception as err:  # noqa: BLE001 - rendezvous failures come in many types
            raise BadRequest(
                f"cannot join weight-transfer group {info.group!r} at {info.master_address}:"
                f"{info.master_port} as rank {info.rank_offset} of {info.world_size}: {one_line(err)}"
            ) from None
        previous = self.receivers.pop(info.group, None)
        if previous is not None:
            previous.group.shutdown()
        self.receivers[info.group] = BucketReceiver(
            group, ipc_device=device if info.payload == "cuda_ipc" else None
        )
        return {"message": "Weight transfer initialized"}

    async def shutdown(self) -> dict:
        for receiver in self.receivers.values():
            receiver.group.shutdown()
        self.receivers.clear()
        return {"message": "Weight transfer shut down"}

    async def start(self) -> dict:
        if self.update_active:
            raise BadRequest(
                "start_weight_update called while a weight update is already active", HTTPStatus.CONFLICT
            )
        self.update_active = True
        return {"message": "Weight update started"}

    async def update(self, body: bytes) -> dict:
        if not self.update_active:
            raise BadRequest("start_weight_update must be called before update_weights", HTTPStatus.CONFLICT)
        # any failure ends the update, a malformed body too (parsed here, not by FastAPI, for that):
        # the trainer's next start_weight_update must not find one still active
        try:
            parsed = UpdateWeightsBody.model_validate_json(body)
            await _receive_and_load(self, parsed.update_info)
        except ValidationError as err:
            self.update_active = False
            raise BadRequest(invalid_request(err.errors())) from None
        except BaseException:
            self.update_active = False
            raise
        return {"message": "Weights updated"}

    async def finish(self, weight_version: str | None) -> dict:
        if not self.update_active:
            raise BadRequest(
                "finish_weight_update called without a matching start_weight_update", HTTPStatus.CONFLICT
            )
        self.update_active = False
        if weight_version is not None and str(self.engine.weight_version) != weight_version:
            await _call(self.engine.update_weights, [], weight_version)  # tag without new tensors
        return {"message": "Weight update finished"}


def weight_update_router(transfer) -> APIRouter:
    """The routes over ``transfer``: a ``WeightTransfer``, or a proxy with the same async methods
    that runs them where the engine is."""
    router = APIRouter()

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = Query(False)):
        return await transfer.reset_prefix_cache(reset_running_requests)

    @router.get("/get_world_size")
    async def get_world_size():
        return {"world_size": 1}

    @router.get("/weight_info")
    async def weight_info():
        return await transfer.weight_info()

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(init_info: InitInfo = Body(..., embed=True)):
        return await transfer.init(init_info)  # the body key names the parameter

    @router.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine():
        return await transfer.shutdown()

    @router.post("/start_weight_update")
    async def start_weight_update():
        return await transfer.start()

    @router.post("/update_weights")
    async def update_weights(request: Request):
        return await transfer.update(await request.body())

    @router.post("/finish_weight_update")
    async def finish_weight_update(weight_version: str | None = Body(None, embed=True)):
        return JSONResponse(await transfer.finish(weight_version))

    return router


async def _receive_and_load(state: WeightTransfer, update_info: UpdateInfo) -> None:
    """Receive one whole update, then write it (a failed transfer leaves the previous weights)."""
    engine = state.engine
    receiver = state.receivers.get(update_info.group)
    if receiver is None:
        raise BadRequest(
            f"weight-transfer group {update_info.group!r} was never initialized "
            f"(known: {sorted(state.receivers)})"
        )
    try:
        received = await asyncio.to_thread(lambda: [pair for bucket in receiver.receive() for pair in bucket])
    except Exception as err:
        # the receiver no longer knows where the stream stands: the group cannot carry another update
        state.receivers.pop(update_info.group, None)
        receiver.group.shutdown()
        message = (
            f"receiving the weights failed, nothing was written: {one_line(err)}; weight-transfer group "
            f"{update_info.group!r} was shut down (call /init_weight_transfer_engine again)"
        )
        if isinstance(err, MalformedStream | CollectiveTimeout):  # the sender's stream, not this server
            raise BadRequest(message) from None
        raise HTTPException(500, message) from err
    adapter_update = any(is_adapter_update_name(name) for name, _ in received)
    names = set(engine.update_names(adapter_update))
    if adapter_update:  # the weights trained in full beside the adapters (lora_modules_to_save) count too
        names |= {name for name, _ in received if not is_adapter_update_name(name)}
    start = time.perf_counter()
    try:
        # the KV of running requests is kept here; /reset_prefix_cache decides whether it is recomputed
        await _call(engine.update_weights, received, update_info.version, False)
    except Exception as err:
        # report anyway (nothing written: the canary fails) so the trainer is not left waiting for
        # this worker in the report gather
        await asyncio.to_thread(receiver.send_report, 0, len(names), 0.0)
        message = f"loading the received weights failed: {one_line(err)}"
        if isinstance(err, ValueError):  # the engine's refusal of bad tensors: names, shapes, NaN/Inf
            raise BadRequest(message) from None
        raise HTTPException(500, message) from err
    written = names & {name for name, _ in received}
    await asyncio.to_thread(receiver.send_report, len(written), len(names), time.perf_counter() - start)
