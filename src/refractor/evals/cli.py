"""``refractor evals``: list the dedicated evals visible from here (any environment is an eval too).
``refractor eval``: run the evals of a config on saved models, without training."""

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


def eval_command(
    ctx: typer.Context,
    config: str = typer.Option(None, "--config", "-c", help="Eval config YAML (docs/evals.md)."),
    resume: bool = typer.Option(False, "--resume", help="Continue a run: skip prompts already evaluated."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing run of the same name."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress lines, only the table."),
) -> None:
    """Evaluate a model, a checkpoint or every checkpoint of a run (no training): servers as in
    training, results in runs/<run_name>/run.db and printed as a table.

    Any key can be overridden: `refractor eval --config e.yaml --checkpoint_dir runs/x --steps "[10, 20]"`.
    """
    from refractor.config import ConfigError
    from refractor.errors import RefractorUserError
    from refractor.evals.standalone import print_summary, run_standalone_evals
    from refractor.evals.standalone_config import load_eval_config
    from refractor.runtime import stop_signals

    err = Console(stderr=True)
    try:
        keys, cfg = load_eval_config(config, list(ctx.args))
        stop_signals.install()
        run_dir, summaries = run_standalone_evals(keys, cfg, resume=resume, overwrite=overwrite, quiet=quiet)
    except ConfigError as e:
        err.print(f"[bold red]error:[/] invalid configuration\n{e}", highlight=False)
        raise typer.Exit(2) from None
    except RefractorUserError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print(f"[bold red]error:[/] interrupted ({stop_signals.signal_name()})", highlight=False)
        raise typer.Exit(stop_signals.exit_code()) from None
    print_summary(summaries, run_dir)


def register(app: typer.Typer) -> None:
    app.command("evals")(evals_command)
    app.command("eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
        eval_command
    )
