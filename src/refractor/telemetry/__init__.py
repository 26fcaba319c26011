"""Telemetry: the local run store (``runs/<run>/run.db``), its query API, derived rollout metrics,
console progress and the optional W&B sink.

* :class:`~refractor.telemetry.store.RunStore` — single writer (the orchestrator), SQLite WAL.
* :mod:`~refractor.telemetry.query` — ``list_runs``, ``RunReader`` (step metrics as rows,
  rollouts by step/status, turns and tool calls, timeline range, system metrics, the code
  snapshot), ``diff_code`` (two runs' code, file by file).
* :func:`~refractor.telemetry.code_snapshot.take_code_snapshot` — the code a run starts with
  (its project's git state and files, its user environment folders).
* :func:`~refractor.telemetry.metrics.rollout_step_metrics` — derived rollout metrics
  (docs/metrics.md#rollout-metrics);
  :func:`~refractor.telemetry.step_metrics.step_metrics` — everything stored for one training step.
* :class:`~refractor.telemetry.system.NodeSampler` (one machine's CPU, memory and NVML GPU metrics;
  sampled on every node by ``refractor.runtime.node_metrics``),
  :class:`~refractor.telemetry.server_metrics.ServerMetricsScraper` — periodic node and server metrics.
* :class:`~refractor.telemetry.console.ConsoleSink`, :class:`~refractor.telemetry.wandb_sink.WandbSink`
  (import the latter only when ``use_wandb`` is on).
"""

from refractor.telemetry.console import ConsoleSink
from refractor.telemetry.metrics import RolloutSummary, rollout_step_metrics
from refractor.telemetry.query import RunReader, list_runs
from refractor.telemetry.store import RunStore

__all__ = ["ConsoleSink", "RolloutSummary", "RunReader", "RunStore", "list_runs", "rollout_step_metrics"]
