"""The dashboard served in a background thread of this process (for tests and the benchmark),
and the system Chromium that drives it there."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from refractor.ui.app import create_app

CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")


def chromium_path() -> str | None:
    for path in CHROMIUM_PATHS:
        if Path(path).is_file():
            return path
    return shutil.which("chromium")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_in_thread(runs_dirs: list[Path], state_dir: Path) -> Iterator[str]:
    """The dashboard on 127.0.0.1 (a free port) until the block ends; yields its base URL."""
    port = free_port()
    config = uvicorn.Config(
        create_app(runs_dirs, state_dir), host="127.0.0.1", port=port, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="refractor-ui", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the dashboard server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
