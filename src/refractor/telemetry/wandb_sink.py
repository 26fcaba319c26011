"""Optional Weights & Biases sink (``pip install 'refractor[wandb]'``, ``use_wandb: true``).

Logs every step metric (plus ``rollout/reward_mean``, Telescope's chart name) and a table of
sample rollouts per step (docs/metrics.md#wb); at the end, the run's component log files as run
files under ``logs/`` (``wandb_upload_logs``) and its code snapshot under ``code/``
(``wandb_upload_code``). ``WANDB_PROJECT`` / ``WANDB_RUN_NAME`` /
``WANDB_TAGS`` (comma list) override the config keys. The local run store is written either way.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TABLE_COLUMNS = [
    "step",
    "group_id",
    "rollout_id",
    "env",
    "prompt",
    "completion",
    "reward",
    "advantage",
    "num_turns",
    "stop_reason",
    "off_policy_steps",
]


def import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise RuntimeError(
            "`use_wandb: true` needs the wandb package: pip install 'refractor[wandb]' "
            "(or set `use_wandb: false`; the local run store is always written)"
        ) from None
    return wandb


class WandbSink:
    def __init__(
        self,
        project: str,
        run_name: str,
        tags: list[str],
        config: dict[str, Any] | None = None,
        run_dir: str | Path | None = None,
        table_rows: int = 16,
        log_dir: str | Path | None = None,
    ) -> None:
        """``log_dir``: the folder whose ``*.log`` files are uploaded when the run ends (None: none)."""
        self.wandb = import_wandb()
        project = os.environ.get("WANDB_PROJECT", project)
        run_name = os.environ.get("WANDB_RUN_NAME", run_name)
        if os.environ.get("WANDB_TAGS"):
            tags = [t.strip() for t in os.environ["WANDB_TAGS"].split(",") if t.strip()]
        self.table_rows = table_rows
        self.log_dir = None if log_dir is None else Path(log_dir)
        self._eval_axis = False
        kwargs: dict[str, Any] = {
            "project": project,
            "name": run_name,
            "tags": list(tags),
            "config": config or {},
        }
        if run_dir is not None:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(run_dir)
        self.run = self.wandb.init(**kwargs)

    @classmethod
    def from_config(
        cls, cfg: Any, run_dir: str | Path | None = None, log_dir: str | Path | None = None
    ) -> WandbSink:
        return cls(
            cfg.wandb_project,
            cfg.wandb_run_name,
            list(cfg.wandb_tags),
            cfg.model_dump(mode="json"),
            run_dir,
            log_dir=log_dir,
        )

    def log_step(self, step: int, metrics: dict[str, float], rollouts: list[Any] | None = None) -> None:
        data: dict[str, Any] = dict(metrics)
        if "reward_sum_mean" in metrics:
            data["rollout/reward_mean"] = metrics["reward_sum_mean"]
        if rollouts:
            table = self.wandb.Table(columns=TABLE_COLUMNS)
            for r in rollouts[: self.table_rows]:
                table.add_data(
                    step,
                    r.group_id,
                    r.rollout_id,
                    r.env_name,
                    r.prompt_text,
                    r.completion_text,
                    r.reward,
                    r.advantage,
                    r.num_turns,
                    r.stop_reason,
                    r.off_policy_steps,
                )
            data["rollouts"] = table
        self.run.log(data, step=step)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Eval metrics on their own x-axis ``eval/step``: a step eval finishes after later training
        steps were logged, and W&B drops rows logged at a step below its current one."""
        if not self._eval_axis:
            self.run.define_metric("eval/step")
            self.run.define_metric("eval/*", step_metric="eval/step")
            self._eval_axis = True
        self.run.log({**metrics, "eval/step": step}, commit=False)

    def warn(self, message: str) -> None:
        """Run-level warnings reach W&B through the console output it records."""

    def upload_code(self, snapshot: Any) -> list[Path]:
        """Save the run's code snapshot as run files ``code/source.zip`` and ``code/metadata.json``
        (``wandb_upload_code``); a failed upload is a warning (the run store holds the code)."""
        from refractor.telemetry.code_snapshot import write_code_archive

        base = Path(self.run.dir)
        try:
            paths = write_code_archive(snapshot, base / "code")
            for path in paths:
                self.run.save(str(path), base_path=str(base), policy="now")
        except Exception as err:  # noqa: BLE001 - the run's end must not fail on an upload
            log.warning("the code snapshot was not uploaded to W&B: %s: %s", type(err).__name__, err)
            return []
        return paths

    def upload_logs(self) -> list[Path]:
        """Save every ``*.log`` of ``log_dir`` as a run file ``logs/<name>`` (what it holds now). A
        failed upload is a warning: the files stay in the run directory either way."""
        if self.log_dir is None or not self.log_dir.is_dir():
            return []
        paths = sorted(self.log_dir.glob("*.log"))
        try:
            for path in paths:
                self.run.save(str(path), base_path=str(self.log_dir.parent), policy="now")
        except Exception as err:  # noqa: BLE001 - the run's end must not fail on an upload
            log.warning("the log files were not uploaded to W&B: %s: %s", type(err).__name__, err)
            return []
        return paths

    def close(self) -> None:
        if self.run is not None:
            self.upload_logs()
            self.run.finish()
            self.run = None
