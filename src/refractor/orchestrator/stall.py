"""Say so when training starves: every finished group discarded as zero-advantage, none kept.

With ``discard_group_zero_advantage`` a group whose samples all score the same carries no
learning signal and is dropped. When the policy has converged (or the task is out of reach) that
is every group, no batch ever fills and the run waits forever while generating. The watch counts
consecutive zero-advantage discards and warns at ``threshold`` and each doubling after it, with
what the user can do.
"""

from __future__ import annotations

from refractor.records import DiscardReason, Group, RolloutStatus


class ZeroAdvantageWatch:
    def __init__(self, threshold: int) -> None:
        self.threshold = max(1, threshold)
        self.streak = 0
        self._next_warning = self.threshold

    def observe(self, group: Group) -> str | None:
        """Feed every completed group; returns a warning when the streak reaches the next mark."""
        if group.status == RolloutStatus.DISCARDED and group.reason == DiscardReason.ZERO_ADVANTAGE:
            self.streak += 1
        elif group.status != RolloutStatus.DISCARDED:
            self.streak = 0
            self._next_warning = self.threshold
        if self.streak < self._next_warning:
            return None
        self._next_warning *= 2
        rewards = sorted({r.reward for r in group.rollouts if r.reward is not None})
        return (
            f"the last {self.streak} finished groups were all discarded as zero-advantage (every sample of a "
            f"group scored the same, e.g. {rewards}), so no training batch can fill. The policy may have "
            "converged, or the task is out of its reach. To train on such groups anyway set "
            "`discard_group_zero_advantage: false`; otherwise stop the run or change the task/rewards."
        )
