"""The zero-advantage watch: warns when every finished group is discarded for having no signal."""

from refractor.orchestrator.stall import ZeroAdvantageWatch
from refractor.records import DiscardReason, Group, Rollout, RolloutStatus


def group(status: RolloutStatus, reason: str = "", reward: float = 1.0) -> Group:
    rollouts = [Rollout(i, 0, i, "env") for i in range(4)]
    for r in rollouts:
        r.reward = reward
    g = Group(0, "env", ("env", 0), rollouts)
    g.mark(status, reason)
    return g


def test_warns_at_the_threshold_and_each_doubling_and_resets_on_a_kept_group():
    watch = ZeroAdvantageWatch(threshold=3)
    zero = lambda: group(RolloutStatus.DISCARDED, DiscardReason.ZERO_ADVANTAGE)  # noqa: E731
    warnings = [watch.observe(zero()) for _ in range(12)]
    assert [i + 1 for i, w in enumerate(warnings) if w] == [3, 6, 12]
    assert "12 finished groups" in warnings[11] and "discard_group_zero_advantage: false" in warnings[11]
    assert "[1.0]" in warnings[11]  # the score every sample got
    # other discards neither count nor reset; a kept group resets the streak and the marks
    assert (
        watch.observe(group(RolloutStatus.DISCARDED, DiscardReason.REWARD_ERROR)) is None
        and watch.streak == 12
    )
    assert watch.observe(group(RolloutStatus.KEPT)) is None and watch.streak == 0
    assert [watch.observe(zero()) is not None for _ in range(3)] == [False, False, True]
