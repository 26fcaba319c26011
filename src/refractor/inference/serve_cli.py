"""``refractor serve``: one inference server process (native engine, or vLLM).

Light at import time (typer only): the CLI imports this module to register the command; torch,
the engine and vLLM load inside the command.
"""

from __future__ import annotations

from pathlib import Path

import typer

from refractor.inference.access import API_KEY_ENV, CONTROL_TOKEN_ENV, MIN_SECRET_CHARS
from refractor.inference.keepalive import SERVER_KEEPALIVE_S


def resolve_model(model: str, max_model_len: int | None) -> tuple[Path, int]:
    """The model's directory (a local path, the HF cache or refractor-testing/<name>, the same for
    both engines) and the sequence limit: ``max_model_len``, else the model's
    ``max_position_embeddings``."""
    import json

    from refractor.hub import ModelNotFoundError, resolve_model_path

    try:
        path = resolve_model_path(model)
    except ModelNotFoundError as err:
        raise typer.BadParameter(str(err), param_hint="--model") from None
    if max_model_len is None:
        config = json.loads((path / "config.json").read_text())
        max_model_len = int(config.get("max_position_embeddings") or 4096)
    return path, max_model_len


def serve(
    model: str = typer.Option(
        ..., "--model", "-m", help="HF checkpoint dir, HF id in the local cache, or refractor-testing/<name>."
    ),
    engine: str = typer.Option("native", "--engine", help="native (refractor's engine) or vllm."),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Bind address; 0.0.0.0 serves every interface (then set --api-key)."
    ),
    port: int = typer.Option(8000, "--port"),
    dtype: str = typer.Option("auto", "--dtype", help="auto: checkpoint dtype on GPU, float32 on CPU."),
    max_model_len: int | None = typer.Option(
        None,
        "--max-model-len",
        help="Longest sequence, prompt and output (default: the model's max_position_embeddings).",
    ),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs"),
    max_num_batched_tokens: int | None = typer.Option(None, "--max-num-batched-tokens"),
    kv_cache_memory_gb: float | None = typer.Option(
        None, "--kv-cache-memory-gb", help="Explicit KV budget (GiB)."
    ),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization"),
    block_size: int = typer.Option(32, "--block-size", help="Native engine: tokens per KV block."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager/--no-enforce-eager", help="No CUDA graphs."),
    enable_sleep_mode: bool = typer.Option(
        False,
        "--enable-sleep-mode/--no-enable-sleep-mode",
        help="/sleep gives the KV cache and the weights' GPU memory back, /wake_up takes it again.",
    ),
    enable_prefix_caching: bool = typer.Option(
        True,
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Prompts reuse the cached KV of full blocks shared with earlier requests.",
    ),
    decode_steps_between_prefills: int = typer.Option(
        32,
        "--decode-steps-between-prefills",
        min=0,
        help="Native engine: while sequences decode, newcomers are prefilled together after this many "
        "steps (or once they fill the prefill token budget); 0: each at once.",
    ),
    max_prefill_delay_ms: float = typer.Option(
        100.0,
        "--max-prefill-delay-ms",
        min=0,
        help="Native engine: and after at most this many milliseconds, however slow the steps are.",
    ),
    async_scheduling: bool = typer.Option(
        True,
        "--async-scheduling/--no-async-scheduling",
        help="Native engine: launch each decode step before the host records the one before it "
        "(the host's bookkeeping overlaps the GPU's work).",
    ),
    engine_process: bool = typer.Option(
        False,
        "--engine-process/--no-engine-process",
        help="Native engine: run the engine in a process of its own, apart from HTTP and tokenization "
        "(in one process they share one GIL).",
    ),
    lora_rank: int = typer.Option(
        0,
        "--lora-rank",
        min=0,
        help="Native engine: serve LoRA adapters of this rank, applied at run time over the loaded model "
        "and set by adapter weight updates (lora_sync: adapter); 0: none.",
    ),
    lora_target_modules: str | None = typer.Option(
        None,
        "--lora-target-modules",
        help="Native engine, with --lora-rank: the projections that carry adapters, comma-separated "
        "(default: all of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj).",
    ),
    seed: int = typer.Option(0, "--seed"),
    served_model_name: str | None = typer.Option(None, "--served-model-name"),
    chat_template: str | None = typer.Option(
        None, "--chat-template", help="A Jinja template, or a file holding one."
    ),
    enable_weight_updates: bool = typer.Option(
        False,
        "--enable-weight-updates",
        help="Mount the control routes (pause, resume, abort, weight updates); needs --control-token.",
    ),
    control_token: str | None = typer.Option(
        None,
        "--control-token",
        envvar=CONTROL_TOKEN_ENV,
        show_envvar=True,
        help="Secret the control routes require (prefer the environment variable: argv is public).",
    ),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar=API_KEY_ENV,
        show_envvar=True,
        help="Secret the generation routes (/v1/..., /inference/v1/generate, /tokenize) require.",
    ),
    enable_docs: bool = typer.Option(False, "--enable-docs", help="Serve the OpenAPI docs at /docs."),
    max_request_body_mb: float = typer.Option(
        32.0, "--max-request-body-mb", min=0.001, help="Native engine: larger request bodies get HTTP 413."
    ),
    timeout_keep_alive: int = typer.Option(
        SERVER_KEEPALIVE_S,
        "--timeout-keep-alive",
        min=1,
        help="Native engine: seconds an idle client connection stays open (longer than clients keep one).",
    ),
    log_level: str = typer.Option("warning", "--log-level"),
) -> None:
    """Serve a model over HTTP with vLLM 0.32's API: completions, chat, generate, and the control
    routes (pause, resume, abort, weight updates) when asked for."""
    from refractor.inference.process import raise_open_file_limit

    raise_open_file_limit()  # one socket per concurrent request
    control_token = _control_token(enable_weight_updates, control_token)
    if api_key is not None and len(api_key) < MIN_SECRET_CHARS:
        raise typer.BadParameter(f"--api-key must be at least {MIN_SECRET_CHARS} characters")
    if chat_template and len(chat_template) < 4096 and Path(chat_template).is_file():
        chat_template = Path(chat_template).read_text()
    if engine not in ("native", "vllm"):
        raise typer.BadParameter(f"--engine must be native or vllm, got {engine!r}")
    path, max_model_len = resolve_model(model, max_model_len)
    served_model_name = served_model_name or model  # clients keep using the name they gave
    if engine == "vllm" and lora_rank:
        raise typer.BadParameter(
            "runtime LoRA adapters are served by the native engine only here; a run with "
            "`lora_sync: adapter` starts its vLLM servers with LoRA itself",
            param_hint="--lora-rank",
        )
    if engine == "vllm":
        # Branch point owned by the vLLM integration (refractor.inference.vllm.launcher).
        from refractor.inference.vllm.launcher import VllmServerSettings, VllmStartError, serve_vllm

        settings = VllmServerSettings(
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_gb=kv_cache_memory_gb,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            seed=seed,
            dtype=dtype,
            served_model_name=served_model_name,
            enforce_eager=enforce_eager or None,
            enable_sleep_mode=enable_sleep_mode,
            enable_prefix_caching=enable_prefix_caching,
        )
        try:
            serve_vllm(
                path,
                host,
                port,
                settings,
                control_token=control_token,
                api_key=api_key,
                enable_docs=enable_docs,
            )
        except VllmStartError as err:  # settings vLLM cannot run with here, said before it starts
            raise typer.BadParameter(str(err)) from None
        return
    import logging

    from refractor.inference.engine import EngineConfig
    from refractor.inference.server import run_native_server

    targets = _lora_targets(lora_target_modules)

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = EngineConfig(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        kv_cache_memory_gb=kv_cache_memory_gb,
        gpu_memory_utilization=gpu_memory_utilization,
        dtype=dtype,
        enforce_eager=enforce_eager,
        enable_sleep_mode=enable_sleep_mode,
        enable_prefix_caching=enable_prefix_caching,
        decode_steps_between_prefills=decode_steps_between_prefills,
        max_prefill_delay_ms=max_prefill_delay_ms,
        async_scheduling=async_scheduling,
        seed=seed,
        lora_rank=lora_rank,
        lora_target_modules=targets,
    )
    run_native_server(
        model,
        host,
        port,
        engine_config=config,
        served_model_name=served_model_name,
        chat_template=chat_template,
        control_token=control_token,
        api_key=api_key,
        enable_docs=enable_docs,
        max_request_body_bytes=int(max_request_body_mb * 2**20),
        timeout_keep_alive_s=timeout_keep_alive,
        log_level=log_level,
        engine_process=engine_process,
    )


def _lora_targets(names: str | None) -> tuple[str, ...]:
    """``--lora-target-modules`` as a tuple of projections (None: all of them)."""
    from refractor.models.lora import ALL_PROJECTIONS

    if names is None:
        return ALL_PROJECTIONS
    targets = tuple(t.strip() for t in names.split(",") if t.strip())
    unknown = sorted(set(targets) - set(ALL_PROJECTIONS))
    if unknown or not targets:
        raise typer.BadParameter(
            f"must name some of {', '.join(ALL_PROJECTIONS)}; got {', '.join(unknown) or 'none'}",
            param_hint="--lora-target-modules",
        )
    return targets


def _control_token(enabled: bool, token: str | None) -> str | None:
    """The token guarding the control routes, or None when they stay off."""
    if not enabled:
        return None
    if not token:
        raise typer.BadParameter(
            f"--enable-weight-updates needs a control token: set {CONTROL_TOKEN_ENV} (or --control-token)"
        )
    if len(token) < MIN_SECRET_CHARS:
        raise typer.BadParameter(f"the control token must be at least {MIN_SECRET_CHARS} characters")
    return token


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
