"""``refractor envs``: list every visible environment with its availability."""

from __future__ import annotations

from dataclasses import dataclass

import typer
from rich.console import Console
from rich.table import Table


@dataclass
class EnvironmentStatus:
    name: str
    source: str
    available: bool
    kind: str = "?"  # single-turn | multi-turn | tool
    dataset_size: int | None = None
    missing: str = ""
    note: str = ""


def environment_status(name: str, spec, load_sizes: bool) -> EnvironmentStatus:
    from refractor.envs.base import Environment
    from refractor.envs.registry import get_environment, load_environment_class
    from refractor.envs.tool_env import ToolEnvironment

    status = EnvironmentStatus(
        name, spec.source, available=not spec.missing_packages, missing=", ".join(spec.missing_packages)
    )
    if not status.available:
        status.note = "pip install " + " ".join(spec.missing_packages)
        return status
    try:
        cls: type[Environment] = load_environment_class(name)
    except Exception as err:  # a broken user environment is reported, not fatal for the listing
        status.available = False
        status.note = f"{type(err).__name__}: {err}"[:200]
        return status
    status.kind = (
        "tool" if issubclass(cls, ToolEnvironment) else "multi-turn" if cls.is_multi_turn else "single-turn"
    )
    if load_sizes or getattr(cls, "dataset_is_generated", False):
        try:
            status.dataset_size = len(get_environment(name).load_dataset())
        except Exception as err:
            status.note = f"dataset: {type(err).__name__}: {str(err).splitlines()[0]}"[:200]
    if getattr(cls, "needs_sandbox", False):
        from refractor.envs.sandbox import BwrapProvider

        if not BwrapProvider().available():
            status.note = (status.note + "; " if status.note else "") + "no isolated sandbox here (see bwrap)"
    if spec.missing_optional_packages:
        status.note = (
            (status.note + "; " if status.note else "")
            + "optional: "
            + ", ".join(spec.missing_optional_packages)
        )
    return status


def envs_command(
    sizes: bool = typer.Option(False, "--sizes", help="Load every dataset to show its size (may be slow)."),
    path: list[str] = typer.Option(
        None, "--path", "-p", help="Extra folder(s) holding <name>/environment.py."
    ),
) -> None:
    """List environments: source, availability, type, dataset size (generated datasets, or all with
    --sizes)."""
    from refractor.envs.registry import discover

    table = Table(title="refractor environments")
    for column in ("name", "source", "available", "type", "dataset size", "missing packages", "note"):
        table.add_column(column, overflow="fold")
    for name, spec in sorted(discover(path or None).items()):
        s = environment_status(name, spec, sizes)
        table.add_row(
            s.name,
            s.source,
            "yes" if s.available else "no",
            s.kind,
            "-" if s.dataset_size is None else str(s.dataset_size),
            s.missing or "-",
            s.note,
        )
    Console(width=200).print(table)


def register(app: typer.Typer) -> None:
    app.command("envs")(envs_command)
