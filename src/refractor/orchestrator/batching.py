"""Batch assembly: completed groups -> acceptance test -> bucket -> a training batch.

A group is kept unless a member failed (its reason), the async limit was exceeded at completion
(``max_async``) or, with ``discard_group_zero_advantage`` and more than one sample, all its
advantages are equal (``zero_advantage``: no learning signal). When the bucket holds
``prompts_batch_size_for_trainer`` kept groups, the first ones become the batch of the step
being filled and ``inference_step`` advances. Discards (and cancellations) are counted per reason
in rollouts, and reported with the batch of the step they happened during.

With ``pins`` (``deterministic_rollouts``) groups are judged in prompt-stream order instead of
completion order: a completed group waits until every group with a smaller stream ordinal has
been judged (or cancelled), so a batch's composition does not depend on which group finished
first. Judging stops at a cut after which the next batch needs newer weights (or after the last
batch); the groups still waiting are then taken back with :meth:`BatchAssembler.requeue_waiting`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from refractor.orchestrator.async_gate import StepCounters, VersionPins, within_async_limit
from refractor.records import DiscardReason, Group, PromptRef, Rollout, RolloutStatus


@dataclass
class Batch:
    step: int
    groups: list[Group]
    discarded_rollouts: list[Rollout] = field(default_factory=list)  # discarded while this step was filled
    cancelled_rollouts: list[Rollout] = field(default_factory=list)

    @property
    def rollouts(self) -> list[Rollout]:
        return [r for g in self.groups for r in g.rollouts]

    @property
    def discarded(self) -> Counter[str]:
        """Rollouts per discard reason."""
        return Counter(r.reason for r in self.discarded_rollouts)

    @property
    def cancelled(self) -> Counter[str]:
        return Counter(r.reason for r in self.cancelled_rollouts)


class BatchAssembler:
    def __init__(
        self,
        prompts_batch_size_for_trainer: int,
        max_async_rollout: int,
        discard_group_zero_advantage: bool,
        is_zero_advantage: Callable[[list[float]], bool],
        number_of_steps: int | None = None,
        pins: VersionPins | None = None,
    ) -> None:
        self.batch_size = prompts_batch_size_for_trainer
        self.number_of_steps = number_of_steps  # no batch is cut past the last step
        self.max_async_rollout = max_async_rollout
        self.discard_zero_advantage = discard_group_zero_advantage
        self.is_zero_advantage = is_zero_advantage
        self.bucket: list[Group] = []
        self.discarded: list[Rollout] = []
        self.cancelled: list[Rollout] = []
        self.pins = pins
        self.next_ordinal = 0  # in stream order: the next group to judge
        self.waiting: dict[int, Group] = {}  # in stream order: completed, not judged yet (by ordinal)
        self._skipped: set[int] = set()  # cancelled ordinals that will not come back

    @property
    def in_stream_order(self) -> bool:
        return self.pins is not None

    def add(self, group: Group, counters: StepCounters) -> list[Batch]:
        """A completed group (advantages already set): judge it (in stream order: when its turn comes);
        return the batches completed."""
        group.completion_version = counters.loaded_version
        if not self.in_stream_order:
            return self._judge(group, counters)
        if group.ordinal < self.next_ordinal or group.ordinal in self.waiting:
            raise ValueError(
                f"group {group.group_id}: stream ordinal {group.ordinal} was already judged or is waiting"
            )
        self.waiting[group.ordinal] = group
        return self._judge_in_order(counters)

    def _judge_in_order(self, counters: StepCounters) -> list[Batch]:
        assert self.pins is not None
        batches: list[Batch] = []
        while True:
            while self.next_ordinal in self._skipped:
                self._skipped.discard(self.next_ordinal)
                self.next_ordinal += 1
            group = self.waiting.pop(self.next_ordinal, None)
            if group is None:
                return batches
            self.next_ordinal += 1
            cut = self._judge(group, counters)
            batches += cut
            if cut and self.pins.requeue_after_cut(counters.inference_step):
                return batches  # the rest waits for requeue_waiting(): it was generated with the old weights

    def requeue_waiting(self) -> list[PromptRef]:
        """Give up the completed groups still waiting (marked cancelled, reason ``requeued``);
        return their prompts."""
        groups = [self.waiting[o] for o in sorted(self.waiting)]
        self.waiting.clear()
        for g in groups:
            g.mark(RolloutStatus.CANCELLED, DiscardReason.REQUEUED)
            self.cancelled += g.rollouts
        return [g.prompt_ref for g in groups]

    def unconsumed(self) -> list[Group]:
        """Groups completed but not in a batch yet (their prompts are replayed after a resume)."""
        return [*self.bucket, *(self.waiting[o] for o in sorted(self.waiting))]

    def _judge(self, group: Group, counters: StepCounters) -> list[Batch]:
        failed = [r for r in group.rollouts if r.status == RolloutStatus.DISCARDED]
        if failed:
            group.mark(RolloutStatus.DISCARDED, DiscardReason.GROUP_MEMBER_FAILED)
        elif not within_async_limit(counters, self.max_async_rollout):
            group.mark(RolloutStatus.DISCARDED, DiscardReason.MAX_ASYNC)
        elif (
            self.discard_zero_advantage
            and len(group.rollouts) > 1
            and self.is_zero_advantage(group.advantages)
        ):
            group.mark(RolloutStatus.DISCARDED, DiscardReason.ZERO_ADVANTAGE)
        else:
            group.mark(RolloutStatus.KEPT)
            self.bucket.append(group)
        if group.status == RolloutStatus.DISCARDED:
            self.discarded += group.rollouts
        return self._cut(counters)

    def add_cancelled(self, group: Group) -> None:
        """A cancelled group; in stream order a group whose prompt runs again (requeued, or its server
        restarted) keeps its ordinal's turn, others give it up."""
        self.cancelled += group.rollouts
        runs_again = group.reason in (DiscardReason.REQUEUED, DiscardReason.SERVER_RESTART)
        if self.in_stream_order and not runs_again and group.ordinal >= self.next_ordinal:
            self._skipped.add(group.ordinal)

    def _cut(self, counters: StepCounters) -> list[Batch]:
        batches = []
        while len(self.bucket) >= self.batch_size and (
            self.number_of_steps is None or counters.inference_step < self.number_of_steps
        ):
            groups = self.bucket[: self.batch_size]
            self.bucket = self.bucket[self.batch_size :]
            step = counters.inference_step
            for g in groups:
                g.step = step
            batches.append(Batch(step, groups, self.discarded, self.cancelled))
            self.discarded = []
            self.cancelled = []
            counters.inference_step += 1
        return batches
