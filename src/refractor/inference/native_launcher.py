"""Start refractor's native inference server in a subprocess (``refractor serve --engine native``).

Kept apart from the server module itself: whoever only launches a server (a run's server actors)
does not import torch, FastAPI and the engine to do so.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

from refractor.inference.access import CONTROL_TOKEN_ENV
from refractor.inference.process import ServerProcess, client_host, free_port


def start_native_server(
    model: str,
    host: str = "127.0.0.1",
    port: int | None = None,
    *,
    engine_args: dict[str, Any] | None = None,
    served_model_name: str | None = None,
    chat_template: str | None = None,
    control_token: str | None = None,
    env: dict[str, str] | None = None,
    startup_timeout_s: float = 180.0,
    log_path: str | None = None,
    die_with_parent: bool = False,
) -> ServerProcess:
    """Run ``refractor serve --engine native`` in a subprocess and wait for ``/health``.

    ``engine_args``: ``EngineConfig`` fields as CLI options (max_model_len, kv_cache_memory_gb,
    dtype, max_num_seqs, gpu_memory_utilization, enforce_eager, block_size, seed).
    ``control_token``: enables the control routes, guarded by it (handed over in the child's
    environment, not its command line).
    """

    port = port or free_port(client_host(host))
    argv = [
        sys.executable,
        "-m",
        "refractor.cli",
        "serve",
        "--model",
        str(model),
        "--engine",
        "native",
        "--host",
        host,
        "--port",
        str(port),
    ]
    for key, value in (engine_args or {}).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif value is not None:
            argv += [flag, str(value)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if chat_template:
        argv += ["--chat-template", chat_template]
    env = dict(env or {})
    if control_token is not None:
        argv.append("--enable-weight-updates")
        env[CONTROL_TOKEN_ENV] = control_token
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="refractor-native-", suffix=".log")
        os.close(fd)
    server = ServerProcess.spawn(
        argv,
        url=f"http://{client_host(host)}:{port}",
        log_path=log_path,
        env=env,
        what=f"native server for {model}",
        die_with_parent=die_with_parent,
    )
    return server.wait_healthy(startup_timeout_s)
