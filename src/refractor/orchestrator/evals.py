"""When evals run during training, and on which servers (reference §1.13, §6.4).

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
     previous step eval still runs waits for it first (as the reference's trainer does).
* **final** (``eval_after_training``): after the last step, reported at step ``number_of_steps``,
  skipping evals that already ran at that step. Eval servers still holding older weights first get
  a ``full`` update.

Baseline and final evals use every server with ``eval_start_end_use_all_servers``, else only the
eval servers. Without eval servers only baseline and final evals can run.

Integration: :func:`attach_evals` sets ``orchestrator.evals`` (called by ``run()`` before the loops
and at the end, and by ``state_dict()`` for the eval id counters) and wraps ``orchestrator.trainer``
in :class:`EvalTrainer`, whose ``update_weights`` applies steps 1-4 around every weight update,
wherever the orchestrator orders it. Results: one rollout row per completion (status ``eval``)
and step metrics ``eval/<name>/<metric>``, ``eval/<name>/pass@k/<metric>``,
``eval/<name>/pass^k/<metric>`` at the reported step; sinks with a ``log_eval(step, metrics)``
method (console, W&B) get them too; timeline events ``eval_<label>_start`` / ``eval_<label>_done``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from refractor.orchestrator.eval_runner import (
    EvalIds,
    EvalResult,
    EvalRunner,
    EvalTask,
    LoadedEval,
    build_task,
)
from refractor.records import TimelineEvent
from refractor.weight_sync import UpdateTarget

log = logging.getLogger("refractor.evals")
EVAL_DRAIN = "eval_drain"  # cancellation reason of training groups drained off the eval servers


def eval_server_names(cfg: Any, server_names: Sequence[str]) -> list[str]:
    """The dedicated eval servers: the last ``eval_num_servers`` (none without evals)."""
    if not cfg.evals or cfg.eval_num_servers <= 0:
        return []
    return list(server_names[-cfg.eval_num_servers :])


class EvalScheduler:
    def __init__(self, orch: Any, loaded: Sequence[LoadedEval], eval_servers: Sequence[str]) -> None:
        cfg = orch.cfg
        self.orch = orch
        self.tasks: list[EvalTask] = [build_task(e, orch.chat, orch.rollout_settings) for e in loaded]
        self.eval_servers = list(eval_servers)
        unknown = set(self.eval_servers) - set(orch.servers)
        if unknown:
            raise ValueError(f"eval servers {sorted(unknown)} are not among the servers {list(orch.servers)}")
        self.runner = EvalRunner(
            orch.chat, cfg.max_concurrent_prompts_per_server * cfg.group_size, orch.clock
        )
        self.ids = EvalIds()
        self.before, self.after = cfg.eval_before_training, cfg.eval_after_training
        self.use_all_servers = cfg.eval_start_end_use_all_servers
        self.done: set[tuple[str, int]] = set()  # (eval name, reported step) already run
        self.active: asyncio.Task | None = None  # the running step eval
        self.eval_version = 0  # weights the eval servers hold
        self.last_version = 0  # latest version ordered by an update
        self.holding_lanes = False  # the eval servers are out of training
        self.rejoin_pending = False

    # ------------------------------------------------------------------ hooks of Orchestrator.run
    async def before_training(self) -> None:
        counters = self.orch.counters
        self.eval_version = self.last_version = counters.loaded_version
        if not self.before or counters.trainer_step > 0:  # no baseline for a resumed run
            return
        servers = self._start_end_servers("baseline")
        if servers:
            await self._run(self.tasks, servers, step=0, version=counters.loaded_version, label="baseline")

    async def after_training(self, completed: bool) -> None:
        """Completed: wait for a running step eval, then the final eval. Otherwise: cancel it."""
        active, self.active = self.active, None
        if not completed:
            if active is not None:
                active.cancel()
                with contextlib.suppress(BaseException):
                    await active
            return
        if active is not None:
            await active
        self._release_lanes()
        step = self.orch.counters.trainer_step
        tasks = [t for t in self.tasks if (t.name, step) not in self.done]
        if not self.after or not tasks:
            return
        servers = self._start_end_servers("final")
        if not servers:
            return
        version = self.orch.counters.loaded_version
        if self.eval_version < version and set(self.eval_servers) & {s.name for s in servers}:
            await self.orch.trainer.trainer.update_weights(version)  # the eval servers missed updates
            self.eval_version = version
        await self._run(tasks, servers, step=step, version=version, label="final")

    def state_dict(self) -> dict[str, Any]:
        return {"ids": self.ids.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ids.load_state_dict(state["ids"])

    # ------------------------------------------------------------------ step evals (EvalTrainer)
    def due(self, version: int) -> list[EvalTask]:
        """Step evals owed to the update to ``version`` (any multiple of eval_every since the last one)."""
        if not self.eval_servers:
            return []
        return [t for t in self.tasks if version // t.eval_every > self.last_version // t.eval_every]

    def raise_if_failed(self) -> None:
        if self.active is not None and self.active.done():
            active, self.active = self.active, None
            active.result()  # re-raises a failed step eval here, in the training loop

    def drain(self) -> None:
        """Take the eval servers out of training: cancel their groups, hold all their lanes."""
        names = set(self.eval_servers)
        for ig in [ig for ig in self.orch.in_flight.values() if ig.server in names]:
            self.orch._cancel_group(ig, EVAL_DRAIN)
        if not self.holding_lanes:
            lanes = self.orch.lanes
            for server in self.eval_servers:
                while lanes.acquire(server, ("eval", server)) is not None:
                    pass
            self.holding_lanes = True
        self.rejoin_pending = False

    def start_step_eval(self, tasks: list[EvalTask], version: int) -> None:
        servers = [self.orch.servers[n] for n in self.eval_servers]
        plan = self.runner.plan(
            tasks, version, self.ids
        )  # ids taken now: a checkpoint right after counts them
        self.active = asyncio.create_task(
            self._run_planned(plan, servers, version, "step"), name="refractor-step-eval"
        )
        self.active.add_done_callback(self._step_eval_finished)

    def _step_eval_finished(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            self.rejoin_pending = True

    def rejoin(self) -> None:
        self._release_lanes()
        self.rejoin_pending = False
        self.orch.wake()

    def _release_lanes(self) -> None:
        if not self.holding_lanes:
            return
        lanes = self.orch.lanes
        for server in self.eval_servers:
            for lane in lanes.held_on(server):
                lanes.release(server, lane, ("eval", server))
        self.holding_lanes = False

    # ------------------------------------------------------------------ running and recording
    def _start_end_servers(self, label: str) -> list[Any]:
        names = list(self.orch.servers) if self.use_all_servers else self.eval_servers
        if not names:
            log.warning(
                "%s eval skipped: `eval_start_end_use_all_servers` is false and there are no eval servers "
                "(`eval_num_servers` is 0)",
                label,
            )
        return [self.orch.servers[n] for n in names]

    async def _run(
        self, tasks: list[EvalTask], servers: list[Any], step: int, version: int, label: str
    ) -> None:
        await self._run_planned(self.runner.plan(tasks, step, self.ids), servers, version, label)

    async def _run_planned(self, plan, servers: list[Any], version: int, label: str) -> None:
        self._event(f"eval_{label}_start", plan.step, version, [s.name for s in servers])
        results = await self.runner.execute(plan, servers, version)
        for result in results:
            self._record(result)
        self._event(f"eval_{label}_done", plan.step, version, [s.name for s in servers])

    def _record(self, result: EvalResult) -> None:
        counters = self.orch.counters
        self.orch.store.log_rollouts(result.rollouts, counters.trainer_step, counters.inference_step)
        metrics = {f"eval/{result.name}/{k}": v for k, v in result.metrics.items()}
        self.orch.store.log_step_metrics(result.step, metrics)
        for sink in self.orch.sinks:
            if hasattr(sink, "log_eval"):
                sink.log_eval(result.step, metrics)
        self.done.add((result.name, result.step))

    def _event(self, name: str, step: int, version: int, servers: list[str]) -> None:
        now = self.orch.clock()
        self.orch.store.log_event(
            TimelineEvent(
                name, now, now, "orchestrator", {"step": step, "version": version, "servers": servers}
            ),
            step=step,
        )


class EvalTrainer:
    """The orchestrator's trainer, with step evals around its weight updates (see the module doc)."""

    def __init__(self, trainer: Any, scheduler: EvalScheduler) -> None:
        self.trainer, self.scheduler = trainer, scheduler

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trainer, name)

    async def train_step(self, step: int, samples: list) -> Any:
        return await self.trainer.train_step(step, samples)

    async def save_checkpoint(self, step: int, orchestrator_state: dict[str, Any]) -> None:
        await self.trainer.save_checkpoint(step, orchestrator_state)

    async def update_weights(self, version: int, target: str | None = None) -> list[TimelineEvent] | None:
        if target is not None:  # an explicit target is the caller's decision
            return await self.trainer.update_weights(version, target=target)
        s = self.scheduler
        s.raise_if_failed()
        due = s.due(version)
        if due and s.active is not None:  # the eval servers must take this update: let their eval finish
            await s.active
            s.raise_if_failed()
        if s.active is not None:
            events = await self.trainer.update_weights(version, target=UpdateTarget.TRAINING_ONLY)
        else:
            if due:
                s.drain()  # before the push: no training request starts there with the new weights
            events = await self.trainer.update_weights(version)
            s.eval_version = version
            if due:
                s.start_step_eval(due, version)
            elif s.rejoin_pending:
                s.rejoin()
        s.last_version = version
        return events


def attach_evals(
    orch: Any, loaded: Sequence[LoadedEval], eval_servers: Sequence[str]
) -> EvalScheduler | None:
    """Give ``orch`` its evals (``orch.evals``) and, with eval servers, the step-eval trainer wrapper."""
    if not loaded:
        return None
    scheduler = EvalScheduler(orch, loaded, eval_servers)
    orch.evals = scheduler
    periodic = [t.name for t in scheduler.tasks if t.eval_every <= orch.number_of_steps]
    if periodic and not scheduler.eval_servers:
        log.warning(
            "evals %s will not run every `eval_every` steps: that needs `eval_num_servers` >= 1 (dedicated "
            "eval servers); only the baseline and final evals run",
            periodic,
        )
    if scheduler.eval_servers:
        orch.trainer = EvalTrainer(orch.trainer, scheduler)
    return scheduler
