"""The orchestrator: dispatch groups onto server lanes, judge them, feed the trainer, order updates.

Everything that mutates orchestrator state runs on one asyncio loop (no locks). Two long-lived
tasks: the *dispatch loop* of :class:`~refractor.orchestrator.dispatch.Dispatcher` (woken whenever
a lane frees, a group completes, weights land or a checkpoint finishes; it starts queued samples
first, then creates new groups while the async gate and the checkpoint gate allow) and the *train
loop* here (takes batches in step order, trains, orders the weight update, cancels stale rollouts,
saves checkpoints). One task per running sample. Each finished group comes back here to be scored
and judged into batches.

Dependencies are injected so they can be Ray actors, HTTP clients or test fakes:
``servers`` (``name`` + ``async generate``), ``trainer`` (:class:`Trainer`), ``store``
(:class:`refractor.telemetry.store.RunStore`-like), ``sinks`` (console, W&B), ``clock``,
``evals`` (:class:`EvalScheduler`, which sees the orchestrator as its :class:`EvalHost`) and
``telemetry`` (periodic collectors run alongside training) and ``latency`` (requests' latency that
servers report apart from their answers: vLLM's trace spans).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from refractor.algorithms.advantages import is_zero_advantage_group, score_group
from refractor.envs.base import Environment
from refractor.errors import RunSetupError
from refractor.orchestrator.async_gate import CheckpointGate, CheckpointSchedule, StepCounters, VersionPins
from refractor.orchestrator.batching import Batch, BatchAssembler
from refractor.orchestrator.chat import run_chat_tokens
from refractor.orchestrator.dispatch import Dispatcher
from refractor.orchestrator.eval_schedule import EvalScheduler
from refractor.orchestrator.inflight import InFlightGroup
from refractor.orchestrator.lanes import LaneManager
from refractor.orchestrator.lifecycle import InflightSnapshots, RolloutEvents
from refractor.orchestrator.prompts import PromptPrefetcher, PromptStream
from refractor.orchestrator.protocols import LatencySource, SleepingServer, StepSink, TelemetryLoop, Trainer
from refractor.orchestrator.rollout import InferenceServer, PreparedPrompt, SerialServer, prepare_prompt
from refractor.orchestrator.settings import OrchestratorSettings
from refractor.orchestrator.stall import ZeroAdvantageWatch
from refractor.orchestrator.train_batch import train_samples
from refractor.records import DiscardReason, Group, PromptRef, RolloutStatus, TimelineEvent
from refractor.telemetry.metrics import RolloutSummary
from refractor.telemetry.step_metrics import StepTiming, step_metrics
from refractor.weight_sync import UpdateTarget

INFLIGHT_SNAPSHOT_INTERVAL_S = 1.0  # the run store's "running now" is at most this old

log = logging.getLogger("refractor.orchestrator")


class Orchestrator:
    def __init__(
        self,
        settings: OrchestratorSettings,
        envs: Sequence[Environment],
        servers: Sequence[InferenceServer],
        trainer: Trainer,
        store: Any,
        tokenizer: Any,
        sinks: Sequence[StepSink] = (),
        clock: Callable[[], float] = time.time,
        evals: EvalScheduler | None = None,
        telemetry: Sequence[TelemetryLoop] = (),
        latency: LatencySource | None = None,
    ) -> None:
        self.settings = settings
        self.envs = {e.name: e for e in envs}
        if len(self.envs) != len(envs):
            raise ValueError(f"environment names must be unique, got {[e.name for e in envs]}")
        self.servers = {s.name: SerialServer(s) if settings.serialize_generation else s for s in servers}
        if not self.servers:
            raise ValueError("the orchestrator needs at least one inference server")
        # a colocated synchronous run: the servers sleep while the trainer steps
        self.sleepers: list[SleepingServer] = list(servers) if settings.inference_sleep_level else []
        self.trainer = trainer
        self.store = store
        self.sinks = list(sinks)
        self.clock = clock
        self.evals = evals
        self.rollout_events = RolloutEvents(
            lambda e: self.store.log_event(e, step=self.counters.inference_step), clock, latency
        )
        self.telemetry = [
            *telemetry,
            InflightSnapshots(self.rollout_events, store.set_meta, INFLIGHT_SNAPSHOT_INTERVAL_S),
        ]
        self.number_of_steps = settings.number_of_steps
        self.counters = StepCounters()
        self.pins = (
            VersionPins(settings.max_async_rollout, settings.checkpoint_every, settings.number_of_steps)
            if settings.deterministic_rollouts
            else None
        )
        self.assembler = BatchAssembler(
            settings.prompts_batch_size_for_trainer,
            settings.max_async_rollout,
            settings.discard_group_zero_advantage,
            is_zero_advantage_group,
            settings.number_of_steps,
            self.pins,
        )
        self.stall_watch = ZeroAdvantageWatch(4 * settings.prompts_batch_size_for_trainer)
        self.ckpt_gate: CheckpointGate[Batch] = CheckpointGate(
            CheckpointSchedule(settings.checkpoint_every, settings.number_of_steps)
        )
        self.chat = run_chat_tokens(tokenizer, settings.enable_thinking)
        weights = {name: w for name, w in settings.env_weights.items() if name in self.envs}
        self.stream = PromptStream({n: len(e) for n, e in self.envs.items()}, weights, seed=settings.seed)
        self.prompts: PromptPrefetcher[PreparedPrompt] = PromptPrefetcher(
            self.stream, self._prepare, settings.prompt_prefetch_buffer_size
        )
        self.dispatch = Dispatcher(
            settings,
            self.envs,
            self.servers,
            self.prompts,
            self.chat,
            replace(settings.rollout, eos_token=tokenizer.eos_token or ""),
            self.counters,
            self.pins,
            self.assembler,
            self.ckpt_gate,
            clock,
            event=self._event,
            on_group_done=self._complete_group,
            rollout_events=self.rollout_events,
        )
        self.train_queue: asyncio.Queue[tuple[int, Batch]] = asyncio.Queue()
        self._batch_cut = asyncio.Event()  # set at every cut (a held weight push may go)
        self._failure: asyncio.Future | None = None
        self._last_step_end: float | None = None
        # one weight push at a time: the step's update and a restarted server's first weights
        self.weights_lock = asyncio.Lock()
        # a failed weight push asks this whether a server was found dead and replaced (then the
        # push runs again); None: a failed push stops the run
        self.server_recovery: Callable[[BaseException], Awaitable[bool]] | None = None

    # The dispatcher's state that callers and tests read through the orchestrator.
    @property
    def lanes(self) -> LaneManager:
        return self.dispatch.lanes

    @property
    def in_flight(self) -> dict[int, InFlightGroup]:
        return self.dispatch.in_flight

    @property
    def generating(self) -> set[int]:
        return self.dispatch.generating

    # ------------------------------------------------------------------ public entry points
    async def run(self) -> None:
        """Train ``number_of_steps`` steps (from the loaded state), then cancel what is still running."""
        loop = asyncio.get_running_loop()
        self.dispatch.start()
        self._failure = loop.create_future()
        preparing = asyncio.create_task(self._prepare_resources(), name="refractor-prepare-resources")
        if self.settings.eager_prepare_resources:
            await preparing  # before the baseline eval and the first rollout
        else:  # rollouts start at once; a failure still ends the run
            preparing.add_done_callback(self._background_failure)
        if self.evals is not None:
            await self.evals.before_training(self)  # the baseline eval, before any rollout
        self._event("training_loop_start")
        self.prompts.refill()
        self.dispatch.wake()
        dispatch = asyncio.create_task(self.dispatch.loop(), name="refractor-dispatch")
        train = asyncio.create_task(self._train_loop(), name="refractor-train")
        telemetry = [asyncio.create_task(t.run(), name="refractor-telemetry") for t in self.telemetry]
        completed = False
        try:
            done, _ = await asyncio.wait(
                {dispatch, train, self._failure}, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                task.result()  # re-raise the first failure
            completed = True
        finally:
            self.dispatch.stopping = True
            for task in (preparing, dispatch, train, *telemetry):
                task.cancel()
            await asyncio.gather(preparing, dispatch, train, *telemetry, return_exceptions=True)
            await self._cancel_all(DiscardReason.SHUTDOWN)
            await self.rollout_events.flush()
            self.prompts.close()
            if self.evals is not None:  # a running step eval ends (or is cancelled); then the final eval
                await self.evals.after_training(self, completed)
            for sink in self.sinks:
                sink.close()

    def state_dict(self) -> dict[str, Any]:
        """Orchestrator state for a checkpoint: counters, ids and the prompt stream (nothing lost)."""
        unconsumed = [g.prompt_ref for _, b in self.ckpt_gate.buffered for g in b.groups]
        unconsumed += [g.prompt_ref for g in self.assembler.unconsumed()]
        unconsumed += self.dispatch.unconsumed_prompts()
        return {
            "counters": self.counters.state_dict(),
            "next_group_id": self.dispatch.next_group_id,
            "next_rollout_id": self.dispatch.next_rollout_id,
            "prompts": self.prompts.state_dict(in_flight=unconsumed),
            "evals": self.evals.state_dict() if self.evals is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters.load_state_dict(state["counters"])
        self.dispatch.next_group_id = int(state["next_group_id"])
        self.dispatch.next_rollout_id = int(state["next_rollout_id"])
        self.prompts.load_state_dict(state["prompts"])
        if self.evals is not None and state.get("evals"):
            self.evals.load_state_dict(state["evals"])
        if self.pins is not None:  # the version schedule and the stream order continue from the checkpoint
            self.pins.resumed_version = self.counters.loaded_version
            if not self.pins.drains_at(self.pins.resumed_version):
                log.warning(
                    "deterministic_rollouts: resuming from version %d, which `checkpoint_every` does not "
                    "save (the last step of a shorter run?); with `max_async_rollout` %d an uninterrupted "
                    "run generated the next batches with older weights, so this run will differ from it",
                    self.pins.resumed_version,
                    self.pins.lag,
                )
            self.assembler.next_ordinal = self.prompts.lowest_unconsumed_ordinal()

    def wake(self) -> None:
        self.dispatch.wake()

    def on_weights_updated(self, version: int) -> list[int]:
        """Servers now hold ``version``: cancel rollouts that became too stale; return their group ids."""
        self.counters.loaded_version = version
        stale = self.dispatch.cancel_off_policy(version)
        self.wake()
        return stale

    def _prepare(self, ref: PromptRef) -> PreparedPrompt:
        return prepare_prompt(self.envs[ref.env_name], ref.index, self.chat, ref.ordinal)

    async def _prepare_resources(self) -> None:
        """Every environment's ``prepare_resources()`` (sandbox pools...), side by side."""

        async def prepare(name: str, env: Environment) -> None:
            try:
                await env.prepare_resources()
            except Exception as err:  # noqa: BLE001 - user environments raise anything; name the env
                raise RunSetupError(
                    f"environment `{name}`: prepare_resources() failed: {type(err).__name__}: {err}"
                ) from err

        await asyncio.gather(*(prepare(name, env) for name, env in self.envs.items()))

    def _background_failure(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and not self._failure.done():
            self._failure.set_exception(task.exception())

    # ------------------------------------------------------------------ finished groups
    def _complete_group(self, group: Group) -> None:
        """A failure here is a bug: it ends the run (``run`` re-raises it)."""
        try:
            self._judge_group(group)
        except Exception as err:
            if self._failure is not None and not self._failure.done():
                self._failure.set_exception(err)

    def _judge_group(self, group: Group) -> None:
        if all(r.status == RolloutStatus.IN_FLIGHT for r in group.rollouts):
            lo, hi = self.settings.reward_ranges.get(group.env_name, (None, None))
            scores = score_group(
                group.rewards,
                [r.num_completion_tokens for r in group.rollouts],
                self.settings.advantages,
                reward_min=lo,
                reward_max=hi,
            )
            for r, adv in zip(group.rollouts, scores.advantages, strict=True):
                r.advantage = adv
        self._event("rollouts_group_done", group_id=group.group_id)
        batches = self.assembler.add(group, self.counters)
        if group.status == RolloutStatus.DISCARDED:
            self._event(f"rollout_discarded_{group.reason}", group_id=group.group_id)
        failed = [r for r in group.rollouts if r.reason == DiscardReason.GENERATION_ERROR]
        if failed:  # a server or transport failure costs a whole group: say so, not only in the store
            self._warn(
                f"{len(failed)} of the {len(group.rollouts)} rollouts of group {group.group_id} failed in "
                f"generation, so the group is discarded: {failed[0].error}",
                "generation_error",
                group_id=group.group_id,
                failed=len(failed),
            )
        if (warning := self.stall_watch.observe(group)) is not None:
            self._warn(warning, "zero_advantage_stall", streak=self.stall_watch.streak)
        for batch in batches:
            self.store.log_rollouts(batch.rollouts, self.counters.trainer_step, batch.step)
            self.store.log_rollouts(
                batch.discarded_rollouts + batch.cancelled_rollouts, self.counters.trainer_step, batch.step
            )
            self._event("save_batch", step=batch.step)
            for item in self.ckpt_gate.on_batch(batch.step, batch):
                self.train_queue.put_nowait(item)
        if batches:
            self._batch_cut.set()
            if self.pins is not None and self.pins.requeue_after_cut(self.counters.inference_step):
                self.dispatch.requeue_past_cut()

    async def _cancel_all(self, reason: str) -> None:
        await self.dispatch.cancel_all(reason)
        leftovers = self.assembler.cancelled + self.assembler.discarded
        for g in self.assembler.unconsumed():  # finished but never trained: recorded as cancelled at shutdown
            g.mark(RolloutStatus.CANCELLED, reason)
            leftovers += g.rollouts
        if leftovers:
            self.store.log_rollouts(leftovers, self.counters.trainer_step, self.counters.inference_step)

    # ------------------------------------------------------------------ the EvalHost of the eval schedule
    def drain_servers(self, names: Sequence[str], reason: str) -> None:
        """Take ``names`` out of training: cancel their groups with ``reason``, hold all their lanes."""
        self.dispatch.drain_servers(names, reason)

    def release_servers(self, names: Sequence[str]) -> None:
        """Give the lanes held by :meth:`drain_servers` back to training."""
        self.dispatch.release_servers(names)

    async def push_weights(self, version: int, target: UpdateTarget) -> None:
        await self._push(version, target)

    # ------------------------------------------------------------------ servers being restarted
    def take_out_server(self, name: str, reason: str) -> None:
        """Stop using server ``name``: its groups are cancelled and run again elsewhere."""
        self.dispatch.take_out(name, reason)

    def bring_back_server(self, name: str) -> None:
        self.dispatch.bring_back(name)

    def record(self, event: TimelineEvent) -> None:
        self.store.log_event(event, step=self.counters.inference_step)

    def warn(self, message: str, event: str, **attrs: Any) -> None:
        self._warn(message, event, **attrs)

    # ------------------------------------------------------------------ training
    async def _train_loop(self) -> None:
        started = self.clock()
        budget = self.settings.max_train_seconds
        while self.counters.trainer_step < self.number_of_steps:
            wait_start = self.clock()
            step, batch = await self.train_queue.get()
            await self._train_one(step, batch, waited=self.clock() - wait_start)
            out_of_time = budget is not None and self.clock() - started >= budget
            if self.ckpt_gate.must_save_after(step) or (out_of_time and self.ckpt_gate.schedule.enabled):
                await self._save_checkpoint(step)
            if out_of_time and self.counters.trainer_step < self.number_of_steps:
                # the run ends here as after its last step: in-flight groups are cancelled, the final
                # eval runs at this step
                log.info(
                    "max_train_minutes (%.4g) ran out after step %d of %d: ending the run",
                    budget / 60,
                    step,
                    self.number_of_steps,
                )
                self._event("train_time_budget_reached", step=step)
                return
            self.wake()

    async def _save_checkpoint(self, step: int) -> None:
        self._event("checkpoint_save_start", step=step)
        # named by the steps completed (step_10 after the tenth), as evals report them
        spans = await self.trainer.save_checkpoint(step + 1, self.state_dict())
        self._event("checkpoint_save_done", step=step)
        self.store.log_events(spans or [], step=step)
        for item in self.ckpt_gate.on_saved():
            self.train_queue.put_nowait(item)

    async def _train_one(self, step: int, batch: Batch, waited: float) -> None:
        t0 = self.clock()
        samples, filtered = train_samples(batch.rollouts, self.settings.advantages, self.settings.filters)
        events = await self._sleep_servers(step)
        result = await self.trainer.train_step(step, samples)
        t1 = self.clock()
        events += result.timeline
        version = step + 1
        held = await self._hold_weights(version)
        # the weights first, so the update lands in GPU memory; the KV cache once the trainer let go
        events += await self._wake_servers(step, ["weights"])
        events += await self._update_weights(version)
        events += await self._wake_servers(step, ["kv_cache"])
        t2 = self.clock()
        self.counters.trainer_step = version
        self.on_weights_updated(version)
        self._event("weight_update", step=step, version=version)
        previous_end = self._last_step_end if self._last_step_end is not None else t0 - waited
        timing = StepTiming(waited, t1 - t0, t2 - t1 - held, t2 - previous_end)
        metrics = filtered | step_metrics(
            [
                RolloutSummary.of(r)
                for r in batch.rollouts + batch.discarded_rollouts + batch.cancelled_rollouts
            ],
            result.metrics,
            timing,
            sum(r.num_completion_tokens for r in batch.rollouts),
            self.counters.async_level(),
            version,
            events,
        )
        self._last_step_end = t2
        self.store.log_step_metrics(step, metrics, timestamp=t2)
        self.store.log_events(events, step=step)
        for sink in self.sinks:
            sink.log_step(step, metrics, batch.rollouts)

    async def _update_weights(self, version: int) -> list[TimelineEvent]:
        """Order the update to ``version``; the eval schedule picks its target (and drains or rejoins
        its servers around it)."""
        if self.evals is None:
            return await self._push(version, UpdateTarget.FULL)
        target = await self.evals.update_target(self, version)
        events = await self._push(version, target)
        self.evals.after_update(self, version, target)
        return events

    async def _push(self, version: int, target: UpdateTarget) -> list[TimelineEvent]:
        """One weight update; when it fails because a server died and that server was replaced, it
        runs again (with the replacement in its group)."""
        while True:
            try:
                async with self.weights_lock:
                    with self.rollout_events.span(
                        "weight_sync", "trainer", record=False, version=version, target=str(target)
                    ):
                        return await self.trainer.update_weights(version, target=target) or []
            except Exception as err:
                if self.server_recovery is None or not await self.server_recovery(err):
                    raise
                log.warning("the weight update to version %d runs again after a server restart", version)

    async def _sleep_servers(self, step: int) -> list[TimelineEvent]:
        level = self.settings.inference_sleep_level
        # wait: requests still in flight (replacements dispatched past the batch) finish first, so
        # none is left to resume while a server's KV cache sleeps (vLLM's /resume in the weight
        # update would run it)
        return await self._each_sleeper(
            "inference_sleep", lambda server: server.sleep(level, "wait"), step=step, level=level
        )

    async def _wake_servers(self, step: int, tags: list[str]) -> list[TimelineEvent]:
        return await self._each_sleeper(
            "inference_wake", lambda server: server.wake_up(tags), step=step, tags=",".join(tags)
        )

    async def _each_sleeper(
        self, name: str, call: Callable[[SleepingServer], Awaitable[None]], **attrs: Any
    ) -> list[TimelineEvent]:
        """``call`` on every sleeping server at once, as one orchestrator span (none: no span)."""
        if not self.sleepers:
            return []
        start = self.clock()
        await asyncio.gather(*(call(server) for server in self.sleepers))
        return [TimelineEvent(name, start, self.clock(), "orchestrator", attrs)]

    async def _hold_weights(self, version: int) -> float:
        """deterministic_rollouts: wait until no batch being filled needs older weights; the seconds held."""
        if self.pins is None:
            return 0.0
        start = self.clock()
        while not self.pins.may_push(version, self.counters.inference_step):
            self._batch_cut.clear()
            await self._batch_cut.wait()
        return self.clock() - start

    # ------------------------------------------------------------------ telemetry
    def _warn(self, message: str, event: str, **attrs: Any) -> None:
        self._event(event, message=message, **attrs)
        for sink in self.sinks:
            sink.warn(message)
        if not self.sinks:
            log.warning(message)

    def _event(self, name: str, **attrs: Any) -> None:
        now = self.clock()
        self.store.log_event(
            TimelineEvent(name, now, now, "orchestrator", attrs),
            step=attrs.get("step", self.counters.inference_step),
        )
