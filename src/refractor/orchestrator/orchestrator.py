"""The orchestrator: dispatch groups onto server lanes, judge them, feed the trainer, order updates.

Everything that mutates orchestrator state runs on one asyncio loop (no locks). Two long-lived
tasks: the *dispatch loop* (woken whenever a lane frees, a group completes, weights land or a
checkpoint finishes; it starts queued samples first, then creates new groups while the async gate
and the checkpoint gate allow) and the *train loop* (takes batches in step order, trains, orders
the weight update, cancels stale rollouts, saves checkpoints). One task per running sample.

Dependencies are injected so they can be Ray actors, HTTP clients or test fakes:
``servers`` (``name`` + ``async generate``), ``trainer`` (:class:`Trainer`), ``store``
(:class:`refractor.telemetry.store.RunStore`-like), ``sinks`` (console, W&B), ``clock``,
``evals`` (:class:`EvalScheduler`, which sees the orchestrator as its :class:`EvalHost`) and
``telemetry`` (periodic collectors run alongside training).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from refractor.algorithms.advantages import is_zero_advantage_group, score_group
from refractor.envs.base import Environment
from refractor.orchestrator.async_gate import (
    CheckpointGate,
    CheckpointSchedule,
    GeneratingRollout,
    StepCounters,
    VersionPins,
    off_policy_groups,
    within_async_limit,
)
from refractor.orchestrator.batching import Batch, BatchAssembler
from refractor.orchestrator.chat import run_chat_tokens
from refractor.orchestrator.eval_schedule import EvalScheduler
from refractor.orchestrator.inflight import InFlightGroup
from refractor.orchestrator.lanes import LaneManager
from refractor.orchestrator.prompts import PromptPrefetcher, PromptStream
from refractor.orchestrator.protocols import StepSink, TelemetryLoop, Trainer
from refractor.orchestrator.rollout import (
    InferenceServer,
    PreparedPrompt,
    SampleHooks,
    SerialServer,
    prepare_prompt,
    run_rollout,
)
from refractor.orchestrator.settings import OrchestratorSettings
from refractor.orchestrator.stall import ZeroAdvantageWatch
from refractor.orchestrator.train_batch import summarize, train_samples
from refractor.records import DiscardReason, Group, PromptRef, Rollout, RolloutStatus, TimelineEvent
from refractor.telemetry.step_metrics import StepTiming, step_metrics
from refractor.weight_sync import UpdateTarget

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
    ) -> None:
        self.settings = settings
        self.envs = {e.name: e for e in envs}
        if len(self.envs) != len(envs):
            raise ValueError(f"environment names must be unique, got {[e.name for e in envs]}")
        self.servers = {s.name: SerialServer(s) if settings.serialize_generation else s for s in servers}
        if not self.servers:
            raise ValueError("the orchestrator needs at least one inference server")
        self.trainer = trainer
        self.store = store
        self.sinks = list(sinks)
        self.clock = clock
        self.evals = evals
        self.telemetry = list(telemetry)
        self.individual = settings.individual_sample_lanes
        self.free_after_generation = settings.free_lane_after_generation and self.individual
        self.group_size = settings.group_size
        self.number_of_steps = settings.number_of_steps
        self.lanes = LaneManager(list(self.servers), settings.lanes_per_server)
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
        # deterministic_rollouts has its own dispatch limit
        self.cap_dispatch = settings.dispatch_only_needed_groups and not settings.deterministic_rollouts
        # moving average of the fraction of finished groups kept (sizes the dispatch cap)
        self.keep_rate = 1.0
        self.ckpt_gate: CheckpointGate[Batch] = CheckpointGate(
            CheckpointSchedule(settings.checkpoint_every, settings.number_of_steps)
        )
        self.chat = run_chat_tokens(tokenizer, settings.enable_thinking)
        self.rollout_settings = replace(settings.rollout, eos_token=tokenizer.eos_token or "")
        weights = {name: w for name, w in settings.env_weights.items() if name in self.envs}
        self.stream = PromptStream({n: len(e) for n, e in self.envs.items()}, weights, seed=settings.seed)
        self.prompts: PromptPrefetcher[PreparedPrompt] = PromptPrefetcher(
            self.stream, self._prepare, settings.prompt_prefetch_buffer_size
        )
        self.in_flight: dict[int, InFlightGroup] = {}
        self.generating: set[int] = set()
        self.train_queue: asyncio.Queue[tuple[int, Batch]] = asyncio.Queue()
        self.next_group_id = 0
        self.next_rollout_id = 0
        self._held_prompt: tuple[PromptRef, PreparedPrompt] | None = None
        self._wake: asyncio.Event | None = None
        self._batch_cut = asyncio.Event()  # set at every cut (a held weight push may go)
        self._failure: asyncio.Future | None = None
        self._stopping = False
        self._paused_by_async = False
        self._last_step_end: float | None = None

    # ------------------------------------------------------------------ public entry points
    async def run(self) -> None:
        """Train ``number_of_steps`` steps (from the loaded state), then cancel what is still running."""
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._failure = loop.create_future()
        if self.evals is not None:
            await self.evals.before_training(self)  # the baseline eval, before any rollout
        self._event("training_loop_start")
        self.prompts.refill()
        self._wake.set()
        dispatch = asyncio.create_task(self._dispatch_loop(), name="refractor-dispatch")
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
            self._stopping = True
            for task in (dispatch, train, *telemetry):
                task.cancel()
            await asyncio.gather(dispatch, train, *telemetry, return_exceptions=True)
            await self._cancel_all(DiscardReason.SHUTDOWN)
            self.prompts.close()
            if self.evals is not None:  # a running step eval ends (or is cancelled); then the final eval
                await self.evals.after_training(self, completed)
            for sink in self.sinks:
                sink.close()

    def state_dict(self) -> dict[str, Any]:
        """Orchestrator state for a checkpoint: counters, ids and the prompt stream (nothing lost)."""
        unconsumed = [g.prompt_ref for _, b in self.ckpt_gate.buffered for g in b.groups]
        unconsumed += [g.prompt_ref for g in self.assembler.unconsumed()]
        unconsumed += [ig.group.prompt_ref for ig in self.in_flight.values()]
        if self._held_prompt is not None:
            unconsumed.append(self._held_prompt[0])
        return {
            "counters": self.counters.state_dict(),
            "next_group_id": self.next_group_id,
            "next_rollout_id": self.next_rollout_id,
            "prompts": self.prompts.state_dict(in_flight=unconsumed),
            "evals": self.evals.state_dict() if self.evals is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters.load_state_dict(state["counters"])
        self.next_group_id = int(state["next_group_id"])
        self.next_rollout_id = int(state["next_rollout_id"])
        self.prompts.load_state_dict(state["prompts"])
        if self.evals is not None and state.get("evals"):
            self.evals.load_state_dict(state["evals"])
        if self.pins is not None:  # the version schedule and the stream order continue from the checkpoint
            self.pins.resumed_version = self.counters.loaded_version
            if not self.pins.drains_at(self.pins.resumed_version):
                log.warning(
                    "deterministic_rollouts: resuming from version %d, which `checkpoint_every` does not save "
                    "(the last step of a shorter run?); with `max_async_rollout` %d an uninterrupted run "
                    "generated the next batches with older weights, so this run will differ from it",
                    self.pins.resumed_version,
                    self.pins.lag,
                )
            self.assembler.next_ordinal = self.prompts.lowest_unconsumed_ordinal()

    # ------------------------------------------------------------------ dispatch
    def _prepare(self, ref: PromptRef) -> PreparedPrompt:
        return prepare_prompt(self.envs[ref.env_name], ref.index, self.chat, ref.ordinal)

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _dispatch_loop(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            await self._dispatch()

    def _may_create_group(self) -> bool:
        if self._stopping or self.ckpt_gate.paused or self.counters.inference_step >= self.number_of_steps:
            return False
        if self.pins is None:
            allowed = within_async_limit(self.counters, self.settings.max_async_rollout)
        else:  # the pinned version is loaded, and at most a batch of finished groups waits on a slower earlier one
            allowed = (
                self.pins.may_dispatch(self.counters)
                and len(self.assembler.waiting) < self.assembler.batch_size
            )
        if allowed == self._paused_by_async:  # log transitions only
            self._paused_by_async = not allowed
            self._event("rollout_resumed_max_async" if allowed else "rollout_paused_max_async")
        return allowed and (not self.cap_dispatch or self._groups_still_needed() > 0)

    def _groups_still_needed(self) -> float:
        """``dispatch_only_needed_groups``: groups the batches open under the async gate still lack, beyond those
        in flight; divided by the recent keep rate so that expected discards are replaced ahead of time."""
        c = self.counters
        open_batches = (
            min(c.loaded_version + self.settings.max_async_rollout, self.number_of_steps - 1)
            - c.inference_step
            + 1
        )
        missing = open_batches * self.settings.prompts_batch_size_for_trainer - len(self.assembler.bucket)
        return missing / max(self.keep_rate, 0.1) - len(self.in_flight)

    async def _dispatch(self) -> None:
        self._start_queued()
        need = 1 if self.individual else self.group_size
        while self._may_create_group():
            server = self.lanes.pick_server(need)
            if server is None:
                return
            taken, self._held_prompt = self._held_prompt, None
            ref, prompt = taken or await self.prompts.take()
            if not self._may_create_group() or self.lanes.free_count(server) < need:
                self._held_prompt = (ref, prompt)  # the world changed while the prompt was prepared
                return
            self._create_group(server, prompt)
            self._start_queued()

    def _create_group(self, server: str, prompt: PreparedPrompt) -> None:
        gid = self.next_group_id
        self.next_group_id += 1
        rollouts = []
        for i in range(self.group_size):
            rollouts.append(
                Rollout(
                    self.next_rollout_id,
                    gid,
                    i,
                    prompt.env_name,
                    prompt_index=prompt.index,
                    prompt_ordinal=prompt.ordinal,
                    server=server,
                )
            )
            self.next_rollout_id += 1
        group = Group(
            gid,
            prompt.env_name,
            (prompt.env_name, prompt.index),
            rollouts,
            ordinal=prompt.ordinal,
            server=server,
            dispatch_version=self.counters.loaded_version,
        )
        ig = InFlightGroup(group, prompt, server)
        self.in_flight[gid] = ig
        self._event("inference_call", group_id=gid, server=server)
        if self.individual:
            ig.queued.extend(range(self.group_size))
            return
        lanes = self.lanes.acquire_many(server, [ig.holder(i) for i in range(self.group_size)])
        assert lanes is not None, "the caller checked that enough lanes are free"
        for i, lane in enumerate(lanes):
            self._start_sample(ig, i, lane)

    def _start_queued(self) -> None:
        for ig in list(self.in_flight.values()):
            while ig.queued and self.lanes.free_count(ig.server) > 0:
                i = ig.queued.popleft()
                self._start_sample(ig, i, self.lanes.acquire(ig.server, ig.holder(i)))

    def _start_sample(self, ig: InFlightGroup, i: int, lane: int | None) -> None:
        assert lane is not None
        ig.lanes[i] = lane
        r = ig.group.rollouts[i]
        r.lane, r.dispatch_time = lane, self.clock()
        ig.tasks[i] = asyncio.create_task(self._run_sample(ig, i), name=f"rollout-{r.rollout_id}")

    def _release(self, ig: InFlightGroup, i: int) -> None:
        lane = ig.lanes.pop(i, None)
        if lane is not None:
            self.lanes.release(ig.server, lane, ig.holder(i))
            self.wake()

    # ------------------------------------------------------------------ one sample
    async def _run_sample(self, ig: InFlightGroup, i: int) -> None:
        r = ig.group.rollouts[i]
        hooks = SampleHooks(
            current_version=lambda: self.counters.loaded_version,
            clock=self.clock,
            generating=self.generating,
            on_generation_end=lambda _: self._release(ig, i) if self.free_after_generation else None,
        )
        try:
            await run_rollout(
                r,
                ig.prompt,
                self.envs[ig.group.env_name],
                self.servers[ig.server],
                self.chat,
                self.rollout_settings,
                hooks,
            )
        except asyncio.CancelledError:
            if not ig.cancelled:
                raise
            return
        except Exception as err:  # a bug in this package, not a user error: record it, keep running
            log.exception("rollout %d failed", r.rollout_id)
            r.mark(RolloutStatus.DISCARDED, DiscardReason.GENERATION_ERROR, f"{type(err).__name__}: {err}")
        finally:
            if self.individual:
                self._release(ig, i)
        if ig.cancelled:
            return
        ig.remaining -= 1
        if ig.remaining == 0:
            try:
                self._complete_group(ig)
            except Exception as err:
                if self._failure is not None and not self._failure.done():
                    self._failure.set_exception(err)
        self.wake()

    # ------------------------------------------------------------------ groups
    def _complete_group(self, ig: InFlightGroup) -> None:
        group = ig.group
        del self.in_flight[group.group_id]
        for i in list(ig.lanes):
            self._release(ig, i)
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
        self.keep_rate = 0.9 * self.keep_rate + 0.1 * (group.status != RolloutStatus.DISCARDED)
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
                self._requeue_past_cut()

    def _requeue_past_cut(self) -> None:
        """deterministic_rollouts: the next batch needs newer weights, so every group past the cut runs
        again under them (same prompts, same ordinals, hence the same sampling seeds)."""
        refs = [ig.group.prompt_ref for ig in self.in_flight.values()] + self.assembler.requeue_waiting()
        for ig in list(self.in_flight.values()):
            self._cancel_group(ig, DiscardReason.REQUEUED)
        if self._held_prompt is not None:
            refs.append(self._held_prompt[0])
            self._held_prompt = None
        self.prompts.put_back(refs)

    def _cancel_group(self, ig: InFlightGroup, reason: str) -> None:
        group = ig.group
        ig.cancelled = True
        self.in_flight.pop(group.group_id, None)
        ig.queued.clear()
        for i in list(ig.lanes):
            self._release(ig, i)
        for task in ig.tasks.values():
            task.cancel()
        for r in group.rollouts:
            if r.first_start_version is not None and r.rollout_id in self.generating:
                r.off_policy_steps = self.counters.loaded_version - r.first_start_version
            self.generating.discard(r.rollout_id)
        group.mark(RolloutStatus.CANCELLED, reason)
        self.assembler.add_cancelled(group)

    async def _cancel_all(self, reason: str) -> None:
        groups = list(self.in_flight.values())
        for ig in groups:
            self._cancel_group(ig, reason)
        await asyncio.gather(*(t for ig in groups for t in ig.tasks.values()), return_exceptions=True)
        leftovers = self.assembler.cancelled + self.assembler.discarded
        for g in self.assembler.unconsumed():  # finished but never trained: recorded as cancelled at shutdown
            g.mark(RolloutStatus.CANCELLED, reason)
            leftovers += g.rollouts
        if leftovers:
            self.store.log_rollouts(leftovers, self.counters.trainer_step, self.counters.inference_step)

    def on_weights_updated(self, version: int) -> list[int]:
        """Servers now hold ``version``: cancel rollouts that became too stale; return their group ids."""
        self.counters.loaded_version = version
        generating = [
            GeneratingRollout(ig.group.group_id, r.first_start_version)
            for ig in self.in_flight.values()
            for r in ig.group.rollouts
            if r.rollout_id in self.generating and r.first_start_version is not None
        ]
        stale = off_policy_groups(generating, version, self.settings.max_off_policy_steps)
        for gid in stale:
            self._cancel_group(self.in_flight[gid], DiscardReason.OFF_POLICY)
            self._event("rollout_cancelled_off_policy", group_id=gid)
        self.wake()
        return stale

    # ------------------------------------------------------------------ the EvalHost of the eval schedule
    def drain_servers(self, names: Sequence[str], reason: str) -> None:
        """Take ``names`` out of training: cancel their groups with ``reason``, hold all their lanes."""
        for ig in [ig for ig in self.in_flight.values() if ig.server in names]:
            self._cancel_group(ig, reason)
        for server in names:
            while self.lanes.acquire(server, ("eval", server)) is not None:
                pass

    def release_servers(self, names: Sequence[str]) -> None:
        """Give the lanes held by :meth:`drain_servers` back to training."""
        for server in names:
            for lane in self.lanes.held_on(server):
                self.lanes.release(server, lane, ("eval", server))
        self.wake()

    async def push_weights(self, version: int, target: str) -> None:
        await self.trainer.update_weights(version, target=target)

    # ------------------------------------------------------------------ training
    async def _train_loop(self) -> None:
        while self.counters.trainer_step < self.number_of_steps:
            wait_start = self.clock()
            step, batch = await self.train_queue.get()
            await self._train_one(step, batch, waited=self.clock() - wait_start)
            if self.ckpt_gate.must_save_after(step):
                self._event("checkpoint_save_start", step=step)
                await self.trainer.save_checkpoint(step, self.state_dict())
                self._event("checkpoint_save_done", step=step)
                for item in self.ckpt_gate.on_saved():
                    self.train_queue.put_nowait(item)
            self.wake()

    async def _train_one(self, step: int, batch: Batch, waited: float) -> None:
        t0 = self.clock()
        samples, filtered = train_samples(batch.rollouts, self.settings.advantages, self.settings.filters)
        result = await self.trainer.train_step(step, samples)
        t1 = self.clock()
        events = list(result.timeline)
        version = step + 1
        held = await self._hold_weights(version)
        events += await self._update_weights(version)
        t2 = self.clock()
        self.counters.trainer_step = version
        self.on_weights_updated(version)
        self._event("weight_update", step=step, version=version)
        previous_end = self._last_step_end if self._last_step_end is not None else t0 - waited
        timing = StepTiming(waited, t1 - t0, t2 - t1 - held, t2 - previous_end)
        metrics = filtered | step_metrics(
            [summarize(r) for r in batch.rollouts + batch.discarded_rollouts + batch.cancelled_rollouts],
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
            return await self.trainer.update_weights(version, target=UpdateTarget.FULL) or []
        target = await self.evals.update_target(self, version)
        events = await self.trainer.update_weights(version, target=target) or []
        self.evals.after_update(self, version, target)
        return events

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
