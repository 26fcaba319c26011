"""The dispatch side of the orchestrator: groups onto free lanes, one task per sample, cancellation.

The :class:`Dispatcher` owns the lanes and the groups in flight. Woken whenever a lane frees, a
group completes, weights land or a checkpoint finishes, it starts queued samples first, then
creates new groups while the async gate (or, with ``deterministic_rollouts``, the version pins)
and the checkpoint gate allow; with ``dispatch_only_needed_groups`` it stops at the groups the
open batches still lack. Every sample runs as its own task; a finished group goes to
``on_group_done`` (judging and batching are the orchestrator's). Groups are cancelled when they
become too stale, when their servers are drained for an eval, when ``deterministic_rollouts``
requeues them past a batch cut, and at shutdown. Everything runs on the orchestrator's one
asyncio loop (no locks).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from refractor.envs.base import Environment
from refractor.orchestrator.async_gate import (
    CheckpointGate,
    GeneratingRollout,
    StepCounters,
    VersionPins,
    off_policy_groups,
    within_async_limit,
)
from refractor.orchestrator.batching import BatchAssembler
from refractor.orchestrator.chat import ChatTokens
from refractor.orchestrator.inflight import InFlightGroup
from refractor.orchestrator.lanes import LaneManager
from refractor.orchestrator.lifecycle import RolloutEvents
from refractor.orchestrator.prompts import PromptPrefetcher
from refractor.orchestrator.rollout import (
    InferenceServer,
    PreparedPrompt,
    RolloutSettings,
    SampleHooks,
    run_rollout,
)
from refractor.orchestrator.settings import OrchestratorSettings
from refractor.records import DiscardReason, Group, PromptRef, Rollout, RolloutStatus

log = logging.getLogger("refractor.orchestrator")


class Dispatcher:
    """Creates groups on free lanes while the gates allow, runs their samples, cancels groups.

    ``event(name, **attrs)`` records a timeline event; ``on_group_done(group)`` receives every
    group whose samples all finished (after its lanes are released).
    """

    def __init__(
        self,
        settings: OrchestratorSettings,
        envs: Mapping[str, Environment],
        servers: Mapping[str, InferenceServer],
        prompts: PromptPrefetcher[PreparedPrompt],
        chat: ChatTokens,
        rollout_settings: RolloutSettings,
        counters: StepCounters,
        pins: VersionPins | None,
        assembler: BatchAssembler,
        ckpt_gate: CheckpointGate[Any],
        clock: Callable[[], float],
        event: Callable[..., None],
        on_group_done: Callable[[Group], None],
        rollout_events: RolloutEvents | None = None,
    ) -> None:
        self.settings = settings
        self.rollout_events = rollout_events
        self.envs = envs
        self.servers = servers
        self.prompts = prompts
        self.chat = chat
        self.rollout_settings = rollout_settings
        self.counters = counters
        self.pins = pins
        self.assembler = assembler
        self.ckpt_gate = ckpt_gate
        self.clock = clock
        self.event = event
        self.on_group_done = on_group_done
        self.individual = settings.individual_sample_lanes
        self.free_after_generation = settings.free_lane_after_generation and self.individual
        self.group_size = settings.group_size
        self.lanes = LaneManager(list(servers), settings.lanes_per_server)
        # deterministic_rollouts has its own dispatch limit
        self.cap_dispatch = settings.dispatch_only_needed_groups and not settings.deterministic_rollouts
        # moving average of the fraction of finished groups kept (sizes the dispatch cap)
        self.keep_rate = 1.0
        self.in_flight: dict[int, InFlightGroup] = {}
        self.generating: set[int] = set()
        self.next_group_id = 0
        self.next_rollout_id = 0
        self.stopping = False
        self._held_prompt: tuple[PromptRef, PreparedPrompt] | None = None
        self._wake: asyncio.Event | None = None
        self._paused_by_async = False

    # ------------------------------------------------------------------ the loop
    def start(self) -> None:
        """Create the wake-up event on the running loop; :meth:`wake` is a no-op before this."""
        self._wake = asyncio.Event()

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def loop(self) -> None:
        assert self._wake is not None
        while not self.stopping:
            await self._wake.wait()
            self._wake.clear()
            await self._dispatch()

    def _may_create_group(self) -> bool:
        c = self.counters
        if self.stopping or self.ckpt_gate.paused or c.inference_step >= self.settings.number_of_steps:
            return False
        if self.pins is None:
            allowed = within_async_limit(c, self.settings.max_async_rollout)
        else:
            # the pinned version is loaded, and at most a batch of finished groups waits on a
            # slower earlier one
            allowed = self.pins.may_dispatch(c) and len(self.assembler.waiting) < self.assembler.batch_size
        if allowed == self._paused_by_async:  # log transitions only
            self._paused_by_async = not allowed
            self.event("rollout_resumed_max_async" if allowed else "rollout_paused_max_async")
        return allowed and (not self.cap_dispatch or self._groups_still_needed() > 0)

    def _groups_still_needed(self) -> float:
        """``dispatch_only_needed_groups``: groups the batches open under the async gate still lack,
        beyond those in flight; divided by the recent keep rate so that expected discards are
        replaced ahead of time."""
        c = self.counters
        last_open_step = min(
            c.loaded_version + self.settings.max_async_rollout, self.settings.number_of_steps - 1
        )
        open_batches = last_open_step - c.inference_step + 1
        missing = open_batches * self.settings.prompts_batch_size_for_trainer - len(self.assembler.bucket)
        return missing / max(self.keep_rate, 0.1) - len(self.in_flight)

    async def _dispatch(self) -> None:
        self._start_queued()
        need = 1 if self.individual else self.group_size
        while self._may_create_group():
            server = self.lanes.pick_server(need)
            if server is None:
                return
            taken = self._held_prompt
            self._held_prompt = None
            ref, prompt = taken or await self.prompts.take()
            if not self._may_create_group() or self.lanes.free_count(server) < need:
                self._held_prompt = (ref, prompt)  # the world changed while the prompt was prepared
                return
            self._create_group(server, prompt)
            self._start_queued()

    # ------------------------------------------------------------------ groups and samples
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
        self.event("inference_call", group_id=gid, server=server)
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
        r.lane = lane
        r.dispatch_time = self.clock()
        ig.tasks[i] = asyncio.create_task(self._run_sample(ig, i), name=f"rollout-{r.rollout_id}")

    def _release(self, ig: InFlightGroup, i: int) -> None:
        lane = ig.lanes.pop(i, None)
        if lane is not None:
            self.lanes.release(ig.server, lane, ig.holder(i))
            self.wake()

    async def _run_sample(self, ig: InFlightGroup, i: int) -> None:
        r = ig.group.rollouts[i]
        hooks = SampleHooks(
            current_version=lambda: self.counters.loaded_version,
            clock=self.clock,
            generating=self.generating,
            on_generation_end=lambda _: self._release(ig, i) if self.free_after_generation else None,
            events=self.rollout_events,
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
            self._finish_group(ig)
        self.wake()

    def _finish_group(self, ig: InFlightGroup) -> None:
        group = ig.group
        del self.in_flight[group.group_id]
        for i in list(ig.lanes):
            self._release(ig, i)
        self.on_group_done(group)
        self.keep_rate = 0.9 * self.keep_rate + 0.1 * (group.status != RolloutStatus.DISCARDED)

    # ------------------------------------------------------------------ cancellation
    def cancel_group(self, ig: InFlightGroup, reason: str) -> None:
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

    async def cancel_all(self, reason: str) -> None:
        """Cancel every group in flight and wait until their sample tasks have ended."""
        groups = list(self.in_flight.values())
        for ig in groups:
            self.cancel_group(ig, reason)
        await asyncio.gather(*(t for ig in groups for t in ig.tasks.values()), return_exceptions=True)

    def cancel_off_policy(self, version: int) -> list[int]:
        """Servers now hold ``version``: cancel the groups with a rollout generating for more than
        ``max_off_policy_steps`` versions; return their group ids."""
        generating = [
            GeneratingRollout(ig.group.group_id, r.first_start_version)
            for ig in self.in_flight.values()
            for r in ig.group.rollouts
            if r.rollout_id in self.generating and r.first_start_version is not None
        ]
        stale = off_policy_groups(generating, version, self.settings.max_off_policy_steps)
        for gid in stale:
            self.cancel_group(self.in_flight[gid], DiscardReason.OFF_POLICY)
            self.event("rollout_cancelled_off_policy", group_id=gid)
        return stale

    def requeue_past_cut(self) -> None:
        """deterministic_rollouts: the next batch needs newer weights, so every group past the cut runs
        again under them (same prompts, same ordinals, hence the same sampling seeds)."""
        refs = [ig.group.prompt_ref for ig in self.in_flight.values()] + self.assembler.requeue_waiting()
        for ig in list(self.in_flight.values()):
            self.cancel_group(ig, DiscardReason.REQUEUED)
        if self._held_prompt is not None:
            refs.append(self._held_prompt[0])
            self._held_prompt = None
        self.prompts.put_back(refs)

    def unconsumed_prompts(self) -> list[PromptRef]:
        """Prompts taken from the stream that no batch holds yet: groups in flight, the held prompt."""
        refs = [ig.group.prompt_ref for ig in self.in_flight.values()]
        if self._held_prompt is not None:
            refs.append(self._held_prompt[0])
        return refs

    # ------------------------------------------------------------------ servers taken out
    def drain_servers(self, names: Sequence[str], reason: str) -> None:
        """For an eval: cancel the groups on ``names`` and hold every lane of theirs."""
        for ig in [ig for ig in self.in_flight.values() if ig.server in names]:
            self.cancel_group(ig, reason)
        for server in names:
            self._hold_lanes(server, ("eval", server))

    def release_servers(self, names: Sequence[str]) -> None:
        for server in names:
            self._release_lanes(server, ("eval", server))
        self.wake()

    def take_out(self, server: str, reason: str) -> None:
        """For a restart: cancel the groups on ``server`` (recorded with ``reason``), put their
        prompts back so that they run again, and hold every lane of the server."""
        groups = [ig for ig in self.in_flight.values() if ig.server == server]
        for ig in groups:
            self.cancel_group(ig, reason)
        self.prompts.put_back([ig.group.prompt_ref for ig in groups])
        self._hold_lanes(server, ("restart", server))
        self.wake()

    def bring_back(self, server: str) -> None:
        self._release_lanes(server, ("restart", server))
        self.wake()

    def _hold_lanes(self, server: str, holder: tuple[str, str]) -> None:
        while self.lanes.acquire(server, holder) is not None:
            pass

    def _release_lanes(self, server: str, holder: tuple[str, str]) -> None:
        for lane in self.lanes.held_on(server):
            if self.lanes.holder(server, lane) == holder:
                self.lanes.release(server, lane, holder)
