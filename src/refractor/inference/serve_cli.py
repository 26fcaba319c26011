"""``refractor serve``: one inference server process (native engine, or vLLM).

Light at import time (typer only): the CLI imports this module to register the command; torch,
the engine and vLLM load inside the command.
"""

from __future__ import annotations

from pathlib import Path

import typer


def serve(
    model: str = typer.Option(
        ..., "--model", "-m", help="HF checkpoint dir, HF id in the local cache, or refractor-testing/<name>."
    ),
    engine: str = typer.Option("native", "--engine", help="native (refractor's engine) or vllm."),
    host: str = typer.Option("0.0.0.0", "--host"),
    port: int = typer.Option(8000, "--port"),
    dtype: str = typer.Option("auto", "--dtype", help="auto: checkpoint dtype on GPU, float32 on CPU."),
    max_model_len: int = typer.Option(4096, "--max-model-len"),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs"),
    max_num_batched_tokens: int | None = typer.Option(None, "--max-num-batched-tokens"),
    kv_cache_memory_gb: float | None = typer.Option(
        None, "--kv-cache-memory-gb", help="Explicit KV budget (GiB)."
    ),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization"),
    block_size: int = typer.Option(32, "--block-size", help="Native engine: tokens per KV block."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager/--no-enforce-eager", help="No CUDA graphs."),
    seed: int = typer.Option(0, "--seed"),
    served_model_name: str | None = typer.Option(None, "--served-model-name"),
    chat_template: str | None = typer.Option(
        None, "--chat-template", help="A Jinja template, or a file holding one."
    ),
    log_level: str = typer.Option("warning", "--log-level"),
) -> None:
    """Serve a model over HTTP with vLLM 0.32's API (completions, chat, generate, control routes)."""
    if chat_template and len(chat_template) < 4096 and Path(chat_template).is_file():
        chat_template = Path(chat_template).read_text()
    if engine == "vllm":
        # Branch point owned by the vLLM integration (refractor.inference.vllm.launcher).
        from refractor.inference.vllm.launcher import VllmServerSettings, serve_vllm

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
        )
        serve_vllm(model, host, port, settings)
        return
    if engine != "native":
        raise typer.BadParameter(f"--engine must be native or vllm, got {engine!r}")
    import logging

    from refractor.inference.engine import EngineConfig
    from refractor.inference.server import run_native_server

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
        seed=seed,
    )
    run_native_server(
        model,
        host,
        port,
        engine_config=config,
        served_model_name=served_model_name,
        chat_template=chat_template,
        log_level=log_level,
    )


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
