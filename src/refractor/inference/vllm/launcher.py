"""Start a vLLM OpenAI server as a subprocess with everything refractor relies on.

The resolved refractor config is translated into explicit vLLM flags (nothing is read from disk
by the child). Always on:
  * ``--logprobs-mode processed_logprobs``: sampled-token logprobs of the temperature-scaled
    distribution, i.e. what the trainer recomputes (vLLM's default returns unscaled ones);
  * ``--generation-config vllm``: the model's ``generation_config.json`` must not inject default
    sampling parameters (Qwen ships temperature/top_k/repetition_penalty defaults);
  * ``--enable-scale-out`` for ``/inference/v1/generate`` (token ids + ``weight_versions``);
  * refractor's access rules (``refractor.inference.access.EnvAccessGuard`` as ``--middleware``):
    vLLM's development routes (``VLLM_SERVER_DEV_MODE=1``: /pause, /resume, weight transfer,
    /collective_rpc, ...) are turned on only with a control token, and every one of them then needs
    it; an API key guards the generation routes; the API docs are off. The secrets reach the server
    through its environment (never its command line);
  * ``/pause`` held to refractor's pause rule (``refractor.inference.vllm.pause_guard``): a pause
    while paused changes nothing and returns at once;
  * refractor's weight-transfer backend (``--weight-transfer-config {"backend": "refractor"}``),
    registered inside each spawned worker by importing the worker extension module.
CPU specifics: ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` CLI of the CPU
wheel crashes looking up the ``vllm`` distribution), an explicit KV-cache size (otherwise vLLM
reserves ``gpu_memory_utilization`` x host RAM), eager mode (torch.compile start-up is slow), and
no chunked prefill: vLLM 0.32 throws away the token sampled after a partial prefill and rewinds the
request's seeded generator by its offset, which a CPU generator does not have: the error kills the
engine, so one seeded request (``deterministic_rollouts``) split over two steps fails every request
after it. Without chunking a step holds whole prompts only, so ``max_num_batched_tokens`` must be at
least ``max_model_len`` there (unset, vLLM takes the larger of it and 2048), as for the native engine.
With ``otlp_traces_endpoint`` (``enable_vllm_tracing``), every finished request's span goes there as
OTLP/HTTP protobuf: the run's receiver (``refractor.telemetry.otlp``) reads its latency from it.
With ``lora_rank`` (``lora_sync: adapter``) the server serves one LoRA adapter under the served model's
name, the base under ``<name>:base``, from a private folder created here and removed when the server
stops (``refractor.inference.vllm.adapter``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from refractor.config.schema import LORA_PROJECTIONS
from refractor.inference.access import API_KEY_ENV, CONTROL_TOKEN_ENV, EnvAccessGuard
from refractor.inference.keepalive import SERVER_KEEPALIVE_S
from refractor.inference.process import ServerProcess, ServerStartError, client_host, free_port

__all__ = [
    "ServerProcess",
    "VllmServerSettings",
    "VllmStartError",
    "client_host",
    "free_port",
    "serve_vllm",
    "start_vllm_server",
    "vllm_command",
]

WORKER_EXTENSION = "refractor.inference.vllm.worker_ext.RefractorWorkerExtension"
PAUSE_GUARD = "refractor.inference.vllm.pause_guard.VllmPauseGuard"
TRANSFER_BACKEND = "refractor"
DEFAULT_CPU_KV_CACHE_GB = 1.0  # used on CPU when kv_cache_memory_gb is not set
TRACE_EXPORT_DELAY_MS = 200


@dataclass(frozen=True)
class VllmServerSettings:
    """The refractor keys that shape a vLLM server (built once from the resolved config)."""

    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float | None = None
    max_model_len: int = 4096
    tensor_parallel_size: int = 1
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    scheduling_policy: str = "priority"
    otlp_traces_endpoint: str | None = None
    seed: int = 0
    dtype: str = "auto"
    served_model_name: str | None = None
    enforce_eager: bool | None = None  # None: eager on CPU, CUDA graphs on GPU
    enable_sleep_mode: bool = False  # /sleep and /wake_up free and retake GPU memory
    enable_prefix_caching: bool = True
    # lora_sync: adapter: one LoRA adapter of this rank on these projections, served under the served
    # model's name and replaced by every adapter push (0: none)
    lora_rank: int = 0
    lora_target_modules: tuple[str, ...] = LORA_PROJECTIONS
    startup_timeout_s: float = 900.0
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(
        cls,
        cfg,
        *,
        served_model_name: str | None = None,
        otlp_traces_endpoint: str | None = None,
        gpu_memory_utilization: float | None = None,
        enable_sleep_mode: bool = False,
    ) -> VllmServerSettings:
        """``otlp_traces_endpoint``: the run's OTLP receiver (``enable_vllm_tracing``), None: no export.
        ``gpu_memory_utilization``: the engine's share resolved for the run's placement (None: the
        config's, or the default of a server with a GPU of its own)."""
        if gpu_memory_utilization is None:
            gpu_memory_utilization = cfg.engine_memory_share(colocated=False)
        return cls(
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_gb=cfg.kv_cache_memory_gb,
            max_model_len=cfg.max_model_len,
            tensor_parallel_size=cfg.inference_tensor_parallel_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            scheduling_policy=cfg.vllm_scheduling_policy,
            otlp_traces_endpoint=otlp_traces_endpoint,
            seed=cfg.seed,
            served_model_name=served_model_name,
            startup_timeout_s=float(cfg.ray_placement_timeout_s),
            enable_sleep_mode=enable_sleep_mode,
            enable_prefix_caching=cfg.enable_prefix_caching,
            lora_rank=cfg.lora_rank if cfg.lora_sync == "adapter" else 0,
            lora_target_modules=tuple(cfg.lora_target_modules),
        )


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def vllm_command(
    model: str,
    host: str,
    port: int,
    settings: VllmServerSettings,
    *,
    on_cpu: bool,
    control_token: str | None = None,
    api_key: str | None = None,
    enable_docs: bool = False,
    adapter_dir: Path | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and the environment additions of a refractor vLLM server (pure; unit-tested).

    ``control_token=None``: no control routes (vLLM's development mode stays off). ``adapter_dir``:
    the served adapter's folder, needed with ``settings.lora_rank``."""
    s = settings
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        s.dtype,
        "--max-model-len",
        str(s.max_model_len),
        "--seed",
        str(s.seed),
        "--tensor-parallel-size",
        str(s.tensor_parallel_size),
        "--scheduling-policy",
        s.scheduling_policy,
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--enable-scale-out",
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--weight-transfer-config",
        json.dumps({"backend": TRANSFER_BACKEND}),
        "--disable-uvicorn-access-log",
        # the last --middleware is the outermost: the access guard checks every call first
        "--middleware",
        PAUSE_GUARD,
        "--middleware",
        f"{EnvAccessGuard.__module__}.{EnvAccessGuard.__qualname__}",
    ]
    if not enable_docs:
        argv.append("--disable-fastapi-docs")
    if s.lora_rank:
        argv += _adapter_args(s.served_model_name or str(model), s, adapter_dir)
    elif s.served_model_name:
        argv += ["--served-model-name", s.served_model_name]
    if on_cpu:
        if s.max_num_batched_tokens is not None and s.max_num_batched_tokens < s.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({s.max_num_batched_tokens}) is below max_model_len "
                f"({s.max_model_len}): vLLM on CPU runs without chunked prefill (a seeded request whose "
                "prompt is split kills its engine), so one step must hold a whole prompt"
            )
        argv.append("--no-enable-chunked-prefill")
    if s.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(s.max_num_seqs)]
    if s.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
    if s.tensor_parallel_size > 1:
        # a server started from a Ray actor must not try to schedule its workers through Ray
        argv += ["--distributed-executor-backend", "mp"]
    kv_gb = (
        s.kv_cache_memory_gb
        if s.kv_cache_memory_gb is not None
        else (DEFAULT_CPU_KV_CACHE_GB if on_cpu else None)
    )
    if kv_gb is not None:
        # an explicit budget bypasses the gpu_memory_utilization check (on CPU: x host RAM)
        argv += ["--kv-cache-memory-bytes", str(int(kv_gb * 2**30))]
    else:
        argv += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    if s.enforce_eager if s.enforce_eager is not None else on_cpu:
        argv.append("--enforce-eager")
    if not s.enable_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    if s.enable_sleep_mode and not on_cpu:  # refused on CPU, where /sleep and /wake_up are no-ops anyway
        argv.append("--enable-sleep-mode")
    # always set, so secrets exported in the launching shell never leak into a server not meant to
    # have them
    env = {
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(SERVER_KEEPALIVE_S),  # outlives the clients' idle connections
        "VLLM_SERVER_DEV_MODE": "1" if control_token else "0",
        CONTROL_TOKEN_ENV: control_token or "",
        API_KEY_ENV: api_key or "",
    }
    if s.lora_rank:
        from refractor.inference.vllm.adapter import ADAPTER_DIR_ENV

        env[ADAPTER_DIR_ENV] = str(adapter_dir)
    if s.otlp_traces_endpoint:
        argv += ["--otlp-traces-endpoint", s.otlp_traces_endpoint]
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
        # the receiver waits for a request's span: export batches every 200 ms, not every 5 s
        env["OTEL_BSP_SCHEDULE_DELAY"] = str(TRACE_EXPORT_DELAY_MS)
    argv += list(s.extra_args)
    env.update(s.extra_env)
    return argv, env


def _adapter_args(name: str, settings: VllmServerSettings, adapter_dir: Path | None) -> list[str]:
    """LoRA on, one adapter at a time, named ``name`` (vLLM refuses an adapter named as a base model:
    the base is served as ``name:base``)."""
    from refractor.inference.vllm.adapter import BASE_NAME_SUFFIX, max_lora_rank

    if adapter_dir is None:
        raise ValueError("a vLLM server with lora_rank > 0 needs the folder of its adapter (adapter_dir)")
    targets = [t for t in LORA_PROJECTIONS if t in settings.lora_target_modules]
    return [
        "--served-model-name",
        name + BASE_NAME_SUFFIX,
        "--enable-lora",
        "--max-lora-rank",
        str(max_lora_rank(settings.lora_rank)),
        "--max-loras",
        "1",
        "--lora-target-modules",
        *targets,
        "--lora-modules",
        json.dumps({"name": name, "path": str(adapter_dir)}),
    ]


class VllmStartError(ServerStartError):
    """The vLLM server exited or did not become healthy; the message ends with its last log lines."""


def start_vllm_server(
    model_path: str | Path,
    host: str = "127.0.0.1",
    port: int | None = None,
    settings: VllmServerSettings | None = None,
    *,
    control_token: str | None = None,
    log_path: str | Path | None = None,
    wait: bool = True,
    die_with_parent: bool = False,
) -> ServerProcess:
    """Start a server in its own process group and (by default) wait until ``/health`` answers.

    ``control_token``: enables the control routes (weight updates, pause, ...), guarded by it."""
    settings = settings or VllmServerSettings()
    port = port or free_port(client_host(host))
    adapter_dir = None
    if settings.lora_rank:
        from refractor.inference.vllm.adapter import create_adapter_folder

        try:
            adapter_dir = create_adapter_folder(
                str(model_path), settings.lora_rank, settings.lora_target_modules
            )
        except ValueError as err:
            raise VllmStartError(f"vLLM server for {model_path}: {err}") from None
    try:
        try:
            argv, env_add = vllm_command(
                str(model_path),
                host,
                port,
                settings,
                on_cpu=not cuda_available(),
                control_token=control_token,
                adapter_dir=adapter_dir,
            )
        except ValueError as err:
            raise VllmStartError(f"vLLM server for {model_path}: {err}") from None
        if log_path is None:
            log_dir = Path(tempfile.mkdtemp(prefix="refractor-vllm-"))
            log_path = log_dir / f"vllm-{port}.log"
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        server = ServerProcess.spawn(
            argv,
            url=f"http://{client_host(host)}:{port}",
            log_path=log_path,
            env=env_add,
            what="vLLM server",
            die_with_parent=die_with_parent,
            scratch_dir=adapter_dir,
        )
    except BaseException:
        if adapter_dir is not None:
            shutil.rmtree(adapter_dir, ignore_errors=True)
        raise
    if wait:
        try:
            server.wait_healthy(settings.startup_timeout_s)
        except ServerStartError as err:
            server.stop()  # also removes the adapter folder
            raise VllmStartError(str(err)) from None
    return server


def serve_vllm(
    model: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    settings: VllmServerSettings | None = None,
    *,
    control_token: str | None = None,
    api_key: str | None = None,
    enable_docs: bool = False,
) -> None:
    """``refractor serve --engine vllm``: run the server in the foreground (this process becomes it)."""
    try:
        argv, env_add = vllm_command(
            str(model),
            host,
            port,
            settings or VllmServerSettings(),
            on_cpu=not cuda_available(),
            control_token=control_token,
            api_key=api_key,
            enable_docs=enable_docs,
        )
    except ValueError as err:
        raise VllmStartError(f"vLLM server for {model}: {err}") from None
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, {**os.environ, **env_add})
