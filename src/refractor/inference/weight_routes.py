"""The weight-update routes of the native server, with vLLM 0.32's names and semantics.

``weight_update_router(engine)`` gives the native server the control plane a stock vLLM server
has in dev mode (``refractor.weight_sync.control_plane`` calls it), so one trainer-side
``WeightSender`` updates both engines: ``/get_world_size``, ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/weight_info``,
``/reset_prefix_cache``, ``/shutdown_weight_transfer_engine``. ``/pause``, ``/resume`` and
``/is_paused`` belong to the server itself (``refractor.inference.server``). The data plane is
the same code vLLM workers run (``refractor.weight_sync.data_plane.BucketReceiver``); the engine
only has to offer ``update_weights(named_tensors, version)``, ``weight_version`` and
``named_parameters()`` (sync or async). Blocking work (rendezvous, receiving) runs in threads so
the server keeps answering ``/health`` meanwhile.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any

import torch
from fastapi import APIRouter, Body, HTTPException, Query
from fastapi.responses import JSONResponse

from refractor.weight_sync.data_plane import BucketReceiver
from refractor.weight_sync.process_group import TransferGroup, check_worker_join


async def _call(fn, *args, **kwargs) -> Any:
    """Await an async engine method; run a sync one in a thread (it may block, e.g. on a weight copy)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.to_thread(fn, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


class _TransferState:
    def __init__(self, engine):
        self.engine = engine
        self.receivers: dict[str, BucketReceiver] = {}
        self.update_active = False

    def engine_device(self) -> torch.device:
        for _, param in self.engine.named_parameters():
            return param.device
        return torch.device("cpu")


def weight_update_router(engine) -> APIRouter:
    state = _TransferState(engine)
    router = APIRouter()

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = Query(False)):
        # the engine has no prefix cache to drop; running requests recompute their KV with the new
        # weights only when asked (vLLM's semantics), else they keep the KV they hold
        if reset_running_requests:
            await _call(engine.recompute_running_kv)
        return {"success": True}

    @router.get("/get_world_size")
    async def get_world_size():
        return {"world_size": 1}

    @router.get("/weight_info")
    async def weight_info():
        version = engine.weight_version
        return {"weight_version": None if version is None else str(version)}

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(init_info: dict[str, Any] = Body(..., embed=True)):
        try:
            group_name = init_info.get("group", "full")
            backend = init_info.get("backend", "gloo")
            create = dict(
                master_address=init_info["master_address"],
                master_port=int(init_info["master_port"]),
                rank=int(init_info["rank_offset"]),
                world_size=int(init_info["world_size"]),
                backend=backend,
                group_name=group_name,
                device=state.engine_device() if backend == "nccl" else None,
                init_timeout_s=float(init_info.get("init_timeout_s", 300.0)),
                timeout_s=float(init_info.get("timeout_s", 300.0)),
            )
            check_worker_join(create["rank"], create["world_size"], create["master_port"], backend)
        except KeyError as err:
            raise HTTPException(400, f"invalid init_info: missing {err}") from None
        except (ValueError, TypeError) as err:
            raise HTTPException(400, f"invalid init_info: {err}") from None
        group = await asyncio.to_thread(lambda: TransferGroup.create(**create))
        previous = state.receivers.pop(group_name, None)
        if previous is not None:
            previous.group.shutdown()
        state.receivers[group_name] = BucketReceiver(group)
        return {"message": "Weight transfer initialized"}

    @router.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine():
        for receiver in state.receivers.values():
            receiver.group.shutdown()
        state.receivers.clear()
        return {"message": "Weight transfer shut down"}

    @router.post("/start_weight_update")
    async def start_weight_update():
        if state.update_active:
            raise HTTPException(409, "start_weight_update called while a weight update is already active")
        state.update_active = True
        return {"message": "Weight update started"}

    @router.post("/update_weights")
    async def update_weights(update_info: dict[str, Any] = Body(..., embed=True)):
        if not state.update_active:
            raise HTTPException(409, "start_weight_update must be called before update_weights")
        group_name = update_info.get("group", "full")
        receiver = state.receivers.get(group_name)
        if receiver is None:
            state.update_active = False
            raise HTTPException(
                400,
                f"weight-transfer group {group_name!r} was never initialized "
                f"(known: {sorted(state.receivers)})",
            )
        try:
            # the whole update is received before anything is written: a failed transfer leaves
            # the engine on its previous weights
            received = await asyncio.to_thread(
                lambda: [pair for bucket in receiver.receive() for pair in bucket]
            )
            names = {name for name, _ in engine.named_parameters()}
            start = time.perf_counter()
            try:
                # the KV of running requests is kept here; /reset_prefix_cache decides whether it is
                # recomputed
                await _call(engine.update_weights, received, update_info.get("version"), False)
            except Exception as err:
                # report anyway (nothing written: the canary fails) so the trainer is not left
                # waiting for this worker in the report gather
                await asyncio.to_thread(receiver.send_report, 0, len(names), 0.0)
                raise HTTPException(500, f"loading the received weights failed: {err!r}") from err
            written = names & {name for name, _ in received}
            await asyncio.to_thread(
                receiver.send_report, len(written), len(names), time.perf_counter() - start
            )
        except BaseException:
            state.update_active = False
            raise
        return {"message": "Weights updated"}

    @router.post("/finish_weight_update")
    async def finish_weight_update(weight_version: str | None = Body(None, embed=True)):
        if not state.update_active:
            raise HTTPException(409, "finish_weight_update called without a matching start_weight_update")
        state.update_active = False
        if weight_version is not None and str(engine.weight_version) != weight_version:
            await _call(engine.update_weights, [], weight_version)  # tag without new tensors
        return JSONResponse({"message": "Weight update finished"})

    return router
