"""When evals run during training, and on which servers (docs/orchestrator.md#scheduling-evals).

* **baseline** (``eval_before_training``): before the first rollout, reported at step 0; skipped
  when the run resumes from a checkpoint.
* **step**: after the update to version ``v`` when ``v % eval_every == 0`` (internal step
  ``s = v - 1``, reported step ``v``), on the dedicated eval servers (the last ``eval_num_servers``),
  which leave training while they evaluate:

  1. *drain*, before the update is pushed: the eval servers' in-flight training groups are
     cancelled (reason ``eval_drain``) and the eval takes every lane of those servers, so the
     dispatcher cannot start training work there;
  2. the update goes to every server (``full``), the eval runs on the eval servers with it;
  3. meanwhile training continues on the other servers and its updates go ``training_only``, so
     the eval servers keep the weights being evaluated;
  4. when the eval is done, the next update is ``full`` again and the eval servers rejoin training
     right after it (fresh lanes, holding the newest weights). An eval step that arrives while the
     previous step eval still runs waits for it first.
* **final** (``eval_after_training``): after the last step, reported at step ``number_of_steps``,
  skipping evals that already ran at that step. Eval servers still holding older weights first get
  a ``full`` update.

Baseline and final evals use every server with ``eval_start_end_use_all_servers``, else only the
eval servers. Without eval servers only baseline and final evals can run.

Integration: :func:`build_eval_schedule` makes the :class:`EvalScheduler` that is passed to the
orchestrator, which calls ``before_training`` before the loops and ``after_training`` at the end,
``state_dict()`` for the eval id counters, and asks ``update_target`` / ``after_update`` around
every weight update it orders (steps 1-4). The orchestrator is seen only through :class:`EvalHost`.
Results (:class:`EvalResults`): one rollout row per completion (status ``eval``) and step metrics
``eval/<name>/<metric>``, ``eval/<name>/pass@k/<metric>``, ``eval/<name>/pass^k/<metric>`` at the
reported step; every step sink's ``log_eval(step, metrics)`` (console, W&B) gets them too; timeline
events ``eval_<label>_start`` / ``eval_<label>_done``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from refractor.orchestrator.async_gate import StepCounters
from refractor.orchestrator.chat import run_chat_tokens
from refractor.orchestrator.eval_runner import (
    EvalIds,
    EvalPlan,
    EvalResult,
    EvalRunner,
    EvalTask,
    LoadedEval,
    build_task,
)
from refractor.orchestrator.protocols import StepSink
from refractor.orchestrator.rollout import InferenceServer, RolloutSettings
from refractor.records import TimelineEvent
from refractor.weight_sync import UpdateTarget

log = logging.getLogger("refractor.evals")
EVAL_DRAIN = "eval_drain"  # cancellation reason of training groups drained off the eval servers


class EvalHost(Protocol):
    """What the eval schedule needs from the orchestrator that runs training."""

    counters: StepCounters
    servers: Mapping[str, InferenceServer]

    def drain_servers(self, names: Sequence[str], reason: str) -> None:
        """Take ``names`` out of training: cancel their groups with ``reason``, hold all their lanes."""

    def release_servers(self, names: Sequence[str]) -> None:
        """Give the lanes held by ``drain_servers`` back to training."""

    async def push_weights(self, version: int, target: UpdateTarget) -> None:
        """Order a weight update to ``version`` for the servers of ``target``; return when it landed."""


class EvalResults:
    """Where eval results go: rows and step metrics in the run store, the step sinks, timeline events."""

    def __init__(self, store: Any, sinks: Sequence[StepSink], clock: Callable[[], float]) -> None:
        self.store = store
        self.sinks = list(sinks)
        self.clock = clock

    def record(self, result: EvalResult, counters: StepCounters) -> None:
        self.store.log_rollouts(result.rollouts, counters.trainer_step, counters.inference_step)
        metrics = {f"eval/{result.name}/{k}": v for k, v in result.metrics.items()}
        self.store.log_step_metrics(result.step, metrics)
        for sink in self.sinks:
            sink.log_eval(result.step, metrics)

    def event(self, name: str, step: int, version: int, servers: list[str]) -> None:
        now = self.clock()
        attrs = {"step": step, "version": version, "servers": servers}
        self.store.log_event(TimelineEvent(name, now, now, "orchestrator", attrs), step=step)


def eval_server_names(cfg: Any, server_names: Sequence[str]) -> list[str]:
    """The dedicated eval servers: the last ``eval_num_servers`` (none without evals)."""
    if not cfg.evals or cfg.eval_num_servers <= 0:
        return []
    return list(server_names[-cfg.eval_num_servers :])


class EvalScheduler:
    def __init__(
        self,
        tasks: Sequence[EvalTask],
        runner: EvalRunner,
        results: EvalResults,
        server_names: Sequence[str],
        eval_servers: Sequence[str],
        before: bool,
        after: bool,
        use_all_servers: bool,
    ) -> None:
        self.tasks = list(tasks)
        self.runner = runner
        self.results = results
        self.server_names = list(server_names)
        self.eval_servers = list(eval_servers)
        unknown = set(self.eval_servers) - set(self.server_names)
        if unknown:
            raise ValueError(f"eval servers {sorted(unknown)} are not among the servers {self.server_names}")
        self.ids = EvalIds()
        self.before = before
        self.after = after
        self.use_all_servers = use_all_servers
        self.done: set[tuple[str, int]] = set()  # (eval name, reported step) already run
        self.active: asyncio.Task | None = None  # the running step eval
        self.eval_version = 0  # weights the eval servers hold
        self.last_version = 0  # latest version ordered by an update
        self.holding_lanes = False  # the eval servers are out of training
        self.rejoin_pending = False

    # ------------------------------------------------------------------ start and end of training
    async def before_training(self, host: EvalHost) -> None:
        counters = host.counters
        self.eval_version = counters.loaded_version
        self.last_version = counters.loaded_version
        if not self.before or counters.trainer_step > 0:  # no baseline for a resumed run
            return
        names = self._start_end_servers("baseline")
        if names:
            plan = self.runner.plan(self.tasks, 0, self.ids)
            await self._run(host, plan, names, counters.loaded_version, "baseline")

    async def after_training(self, host: EvalHost, completed: bool) -> None:
        """Completed: wait for a running step eval, then the final eval. Otherwise: cancel it."""
        active = self.active
        self.active = None
        if not completed:
            if active is not None:
                active.cancel()
                with contextlib.suppress(BaseException):
                    await active
            return
        if active is not None:
            await active
        self._release_lanes(host)
        step = host.counters.trainer_step
        tasks = [t for t in self.tasks if (t.name, step) not in self.done]
        if not self.after or not tasks:
            return
        names = self._start_end_servers("final")
        if not names:
            return
        version = host.counters.loaded_version
        if self.eval_version < version and set(self.eval_servers) & set(names):
            await host.push_weights(version, UpdateTarget.FULL)  # the eval servers missed updates
            self.eval_version = version
        await self._run(host, self.runner.plan(tasks, step, self.ids), names, version, "final")

    def state_dict(self) -> dict[str, Any]:
        return {"ids": self.ids.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ids.load_state_dict(state["ids"])

    # ------------------------------------------------------------------ around every weight update
    async def update_target(self, host: EvalHost, version: int) -> UpdateTarget:
        """The servers the update to ``version`` goes to; drains the eval servers when a step eval is due."""
        self.raise_if_failed()
        due = self.due(version)
        if due and self.active is not None:  # the eval servers must take this update: let their eval finish
            await self.active
            self.raise_if_failed()
        if self.active is not None:
            return UpdateTarget.TRAINING_ONLY
        if due:
            self.drain(host)  # before the push: no training request starts there with the new weights
        return UpdateTarget.FULL

    def after_update(self, host: EvalHost, version: int, target: UpdateTarget) -> None:
        """The update to ``version`` landed: start the step evals it owes, or let the eval servers rejoin."""
        if target == UpdateTarget.FULL:
            due = self.due(version)
            self.eval_version = version
            if due:
                self.start_step_eval(host, due, version)
            elif self.rejoin_pending:
                self.rejoin(host)
        self.last_version = version

    def due(self, version: int) -> list[EvalTask]:
        """Step evals owed to the update to ``version`` (any multiple of eval_every since the last one)."""
        if not self.eval_servers:
            return []
        return [t for t in self.tasks if version // t.eval_every > self.last_version // t.eval_every]

    def raise_if_failed(self) -> None:
        if self.active is not None and self.active.done():
            active = self.active
            self.active = None
            active.result()  # re-raises a failed step eval here, in the training loop

    def drain(self, host: EvalHost) -> None:
        """Take the eval servers out of training: cancel their groups, hold all their lanes."""
        host.drain_servers(self.eval_servers, EVAL_DRAIN)
        self.holding_lanes = True
        self.rejoin_pending = False

    def start_step_eval(self, host: EvalHost, tasks: list[EvalTask], version: int) -> None:
        plan = self.runner.plan(
            tasks, version, self.ids
        )  # ids taken now: a checkpoint right after counts them
        self.active = asyncio.create_task(
            self._run(host, plan, self.eval_servers, version, "step"), name="refractor-step-eval"
        )
        self.active.add_done_callback(self._step_eval_finished)

    def _step_eval_finished(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            self.rejoin_pending = True

    def rejoin(self, host: EvalHost) -> None:
        self._release_lanes(host)
        self.rejoin_pending = False

    def _release_lanes(self, host: EvalHost) -> None:
        if self.holding_lanes:
            host.release_servers(self.eval_servers)
            self.holding_lanes = False

    # ------------------------------------------------------------------ running and recording
    def _start_end_servers(self, label: str) -> list[str]:
        names = self.server_names if self.use_all_servers else self.eval_servers
        if not names:
            log.warning(
                "%s eval skipped: `eval_start_end_use_all_servers` is false and there are no eval servers "
                "(`eval_num_servers` is 0)",
                label,
            )
        return list(names)

    async def _run(self, host: EvalHost, plan: EvalPlan, names: list[str], version: int, label: str) -> None:
        self.results.event(f"eval_{label}_start", plan.step, version, names)
        servers = [host.servers[n] for n in names]
        for result in await self.runner.execute(plan, servers, version):
            self.results.record(result, host.counters)
            self.done.add((result.name, result.step))
        self.results.event(f"eval_{label}_done", plan.step, version, names)


def build_eval_schedule(
    cfg: Any,
    loaded: Sequence[LoadedEval],
    server_names: Sequence[str],
    tokenizer: Any,
    store: Any,
    sinks: Sequence[StepSink],
    clock: Callable[[], float] = time.time,
) -> EvalScheduler | None:
    """The run's eval schedule (None without evals), to pass to the orchestrator."""
    if not loaded:
        return None
    chat = run_chat_tokens(tokenizer, cfg.enable_thinking)
    settings = RolloutSettings.from_config(cfg, tokenizer.eos_token or "")
    scheduler = EvalScheduler(
        [build_task(e, chat, settings) for e in loaded],
        EvalRunner(chat, cfg.lanes_per_server, clock),
        EvalResults(store, sinks, clock),
        server_names,
        eval_server_names(cfg, server_names),
        before=cfg.eval_before_training,
        after=cfg.eval_after_training,
        use_all_servers=cfg.eval_start_end_use_all_servers,
    )
    periodic = [t.name for t in scheduler.tasks if t.eval_every <= cfg.number_of_steps]
    if periodic and not scheduler.eval_servers:
        log.warning(
            "evals %s will not run every `eval_every` steps: that needs `eval_num_servers` >= 1 (dedicated "
            "eval servers); only the baseline and final evals run",
            periodic,
        )
    return scheduler
