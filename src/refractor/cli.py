"""The ``refractor`` command line. Each subcommand lives with its role and is registered here."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from refractor import __version__
from refractor.config import ConfigError, config_to_yaml, load_config
from refractor.errors import RefractorUserError

app = typer.Typer(
    name="refractor",
    help="Asynchronous RL post-training for LLMs. Every command takes --help.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain help text: the boxed layout cuts long flag names (--decode-steps-between-prefills) to fit
    # 80 columns, which is also the width a piped --help gets
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
config_app = typer.Typer(
    help="Inspect and validate configuration files.", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(config_app, name="config")
err_console = Console(stderr=True)

# Options shared by commands that take a config plus free `--key value` overrides.
EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}


def fail(message: str, code: int = 2) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, markup=True, soft_wrap=True)
    raise typer.Exit(code)


def load_or_exit(config: str | None, overrides: list[str]):
    try:
        return load_config(config, overrides)
    except ConfigError as err:
        fail(f"invalid configuration\n{err}")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"refractor {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """refractor: asynchronous RL post-training for LLMs."""


@config_app.command("show", context_settings=EXTRA_ARGS)
def config_show(
    ctx: typer.Context,
    config: str = typer.Option(
        None, "--config", "-c", help="Run config YAML (Telescope YAMLs load unchanged)."
    ),
) -> None:
    """Print the resolved config (defaults <- --config <- --key value overrides) as YAML."""
    cfg = load_or_exit(config, list(ctx.args))
    sys.stdout.write(config_to_yaml(cfg))


@config_app.command("check", context_settings=EXTRA_ARGS)
def config_check(
    ctx: typer.Context, path: str = typer.Argument(..., help="Config YAML to validate.")
) -> None:
    """Validate a config file (plus overrides) and its environment and eval names; exit non-zero
    listing every error."""
    from refractor.config.names import unknown_name_errors

    errors = unknown_name_errors(load_or_exit(path, list(ctx.args)))
    if errors:
        fail("invalid configuration\n" + "\n".join(errors))
    err_console.print(f"[green]ok[/]: {path} is valid")


@config_app.command("defaults")
def config_defaults() -> None:
    """Print every key with its default and description (the source of configs/defaults.yaml)."""
    from refractor.config.docs import render_defaults

    sys.stdout.write(render_defaults())


@app.command("train", context_settings=EXTRA_ARGS)
def train(
    ctx: typer.Context,
    config: str = typer.Option(
        None, "--config", "-c", help="Run config YAML (Telescope YAMLs load unchanged)."
    ),
    quiet: bool = typer.Option(False, "--quiet", help="Plain log lines instead of the progress display."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an existing run directory of the same name."
    ),
) -> None:
    """Train: servers + trainer on Ray, async rollouts, a weight update after every step.

    Any config key can be overridden: `refractor train --config c.yaml --learning_rate 5e-7`.
    """
    cfg = load_or_exit(config, list(ctx.args))
    from refractor.runtime import stop_signals

    stop_signals.install()  # SIGINT and SIGTERM stop the run cleanly, also in the background
    from refractor.train import run_training

    try:
        run_dir = run_training(cfg, quiet=quiet, overwrite=overwrite, config_path=config)
    except RefractorUserError as err:
        fail(str(err), code=1)
    except KeyboardInterrupt:
        fail(
            f"interrupted ({stop_signals.signal_name()}): every server and trainer process was stopped",
            code=stop_signals.exit_code(),
        )
    err_console.print(f"[green]done[/]: run stored in {run_dir}")


@app.command("runs")
def runs(runs_dir: str = typer.Argument("runs", help="The folder that holds the run directories.")) -> None:
    """List the runs under a folder, newest first: status, steps trained, last reward."""
    import time
    from pathlib import Path

    from rich.table import Table

    from refractor.telemetry.query import list_runs

    if not Path(runs_dir).is_dir():
        fail(f"no folder {runs_dir!r}: pass the folder that holds the run directories (run_dir)", code=1)
    found = list_runs(runs_dir)
    if not found:
        err_console.print(f"no runs under {runs_dir}")
        return
    table = Table("run", "status", "steps", "last reward", "created", "path", box=None)
    for run in found:
        table.add_row(
            run.name,
            run.status,
            "0" if run.last_step is None else str(run.last_step + 1),
            "" if run.last_reward is None else f"{run.last_reward:.4g}",
            time.strftime("%Y-%m-%d %H:%M", time.localtime(run.created_at)),
            str(run.path),
        )
    Console(width=200).print(table)


from refractor.trainer.convert import convert_command  # noqa: E402 (light module: torch loads lazily)

app.command("convert")(convert_command)


from refractor.envs.cli import register as _register_envs  # noqa: E402  (`refractor envs`)

_register_envs(app)


from refractor.evals.cli import register as _register_evals  # noqa: E402  (`refractor evals`)

_register_evals(app)


from refractor.inference.serve_cli import register as _register_serve  # noqa: E402  (`refractor serve`)

_register_serve(app)


from refractor.ui.cli import register as _register_ui  # noqa: E402  (`refractor ui`)

_register_ui(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
