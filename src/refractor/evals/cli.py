"""``refractor evals``: list the dedicated evals visible from here (any environment is an eval too)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table


def evals_command(
    path: list[str] = typer.Option(None, "--path", "-p", help="Extra folder(s) holding <name>/eval.py."),
) -> None:
    """List dedicated evals (built-in, $REFRACTOR_EVAL_PATH, ./evals); other names resolve to environments."""
    from refractor.evals.registry import discover_evals, load_eval_class

    table = Table(title="refractor evals (any environment name is an eval too: see `refractor envs`)")
    for column in ("name", "source", "available", "dataset", "note"):
        table.add_column(column, overflow="fold")
    for name, spec in sorted(discover_evals(path or None).items()):
        available = "yes"
        dataset = "-"
        note = ""
        try:
            cls = load_eval_class(spec)
            dataset = getattr(cls, "dataset_id", "") or (
                f"env {cls.environment_name}" if cls.environment_name else "-"
            )
        except Exception as err:  # a broken user eval is reported, not fatal for the listing
            available = "no"
            note = f"{type(err).__name__}: {err}"[:200]
        table.add_row(name, spec.source, available, dataset, note or str(spec.folder))
    Console(width=200).print(table)


def register(app: typer.Typer) -> None:
    app.command("evals")(evals_command)
