"""``refractor ui``: serve the dashboard over one or more runs dirs."""

from __future__ import annotations

import threading
import webbrowser
from pathlib import Path

import typer
from rich.console import Console

err_console = Console(stderr=True)


def ui_command(
    runs_dir: list[Path] = typer.Option(
        [Path("runs")], "--runs-dir", help="A folder of run directories (repeat for several)."
    ),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to bind; 0.0.0.0 exposes it to the network."
    ),
    port: int = typer.Option(8005, "--port", help="Port to serve on."),
    open_browser: bool = typer.Option(True, "--open/--no-open", help="Open the dashboard in a browser."),
    state_dir: Path = typer.Option(
        None, "--state-dir", help="Where the dashboard keeps layouts, notes and hidden runs."
    ),
) -> None:
    """Serve the dashboard: runs, metrics, rollouts, timeline, infra, topology, evals, logs, code."""
    import uvicorn

    from refractor.ui.app import create_app
    from refractor.ui.state import default_state_dir

    missing = [str(d) for d in runs_dir if not d.is_dir()]
    if missing:
        err_console.print(
            f"[yellow]warning:[/] no folder {', '.join(missing)} yet; its runs appear once it exists",
            highlight=False,
        )
    if host not in ("127.0.0.1", "localhost", "::1"):
        err_console.print(
            f"[bold yellow]warning:[/] binding {host}: anyone who can reach this machine can read every "
            "run (prompts, rollouts, code). Prefer the default 127.0.0.1 with `ssh -L 8005:localhost:8005`.",
            highlight=False,
        )
    app = create_app(runs_dir, state_dir or default_state_dir())
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/"
    err_console.print(
        f"refractor dashboard on {url} (runs: {', '.join(map(str, runs_dir))})", highlight=False
    )
    if open_browser:
        threading.Timer(1.0, webbrowser.open, args=(url,)).start()
    uvicorn.run(app, host=host, port=port, log_level="warning")


def register(app: typer.Typer) -> None:
    app.command("ui")(ui_command)
