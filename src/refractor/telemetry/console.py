"""Console progress: a rich progress bar (step, reward, KL, tokens/s, ETA), or plain log lines.

A step sink: the orchestrator calls ``log_step(step, metrics, rollouts)`` after every step,
``log_eval(step, metrics)`` after every eval, ``warn(message)`` for run-level warnings and
``close()`` at the end. ``quiet=True`` (or a non-terminal output) prints one line per step instead.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    return f"{s // 3600:d}:{s // 60 % 60:02d}:{s % 60:02d}"


def step_summary(metrics: dict[str, float]) -> dict[str, float | None]:
    """The numbers shown per step, under the names the console prints."""
    return {
        "reward": metrics.get("reward_sum_mean"),
        "kl": metrics.get("kl_divergence_inference"),
        "tokens_per_s": metrics.get("tokens_per_second"),
    }


class ConsoleSink:
    def __init__(
        self,
        total_steps: int,
        quiet: bool = False,
        console: Console | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        first_step: int = 0,
    ) -> None:
        self.total_steps = total_steps
        self.clock = clock
        self.stream = stream or sys.stdout
        self.console = console or Console(file=self.stream)
        self.quiet = quiet or not self.console.is_terminal
        self.first_step = first_step
        self._start = clock()
        self._progress: Progress | None = None
        if not self.quiet:
            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(bar_width=24),
                TextColumn(
                    "reward [cyan]{task.fields[reward]}[/]  train/infer KL [magenta]{task.fields[kl]}[/]  "
                    "tok/s [green]{task.fields[tps]}[/]"
                ),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=first_step, reward="-", kl="-", tps="-"
            )
            self._progress.start()

    def eta_seconds(self, steps_done: int) -> float | None:
        done_here = steps_done - self.first_step
        if done_here <= 0:
            return None
        return (self.clock() - self._start) / done_here * (self.total_steps - steps_done)

    def warn(self, message: str) -> None:
        """A run-level warning (e.g. training starved), printed above the progress bar."""
        self.console.print(f"[yellow]warning[/]: {message}", highlight=False, soft_wrap=True)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Eval results (``eval/<name>/<metric>``): one line per eval above the progress bar."""
        by_eval: dict[str, list[str]] = {}
        for key, value in metrics.items():
            _, name, metric = key.split("/", 2)
            if not metric.startswith(("num_", "timing_")) and metric != "policy_version":
                by_eval.setdefault(name, []).append(f"{metric}={value:.3f}")
        for name, parts in by_eval.items():
            self.console.print(
                f"eval {name} @ step {step}: " + " ".join(parts), highlight=False, soft_wrap=True
            )

    def log_step(self, step: int, metrics: dict[str, float], rollouts: list[Any] | None = None) -> None:
        s = step_summary(metrics)
        reward = _fmt(s["reward"], ".3f")
        kl = _fmt(s["kl"], ".4f")
        tps = _fmt(s["tokens_per_s"], ".0f")
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1, reward=reward, kl=kl, tps=tps)
        else:
            line = (
                # the KL is the trainer's log-probs against the servers' (kl_divergence_inference)
                f"step {step + 1}/{self.total_steps} reward={reward} train_infer_kl={kl} tokens/s={tps} "
                f"eta={_eta(self.eta_seconds(step + 1))}"
            )
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
