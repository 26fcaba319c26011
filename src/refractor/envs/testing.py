"""Test helpers: finished rollouts from hand-written completions (no model, no server)."""

from __future__ import annotations

from refractor.envs.base import Environment
from refractor.records import RolloutState, Sample, TrajectoryStep


def finished_state(env: Environment, sample: Sample, *completions: str) -> RolloutState:
    """A rollout whose model turns produced ``completions`` (env responses are not replayed)."""
    state = env.create_initial_state(sample)
    messages = env.get_initial_prompt(sample)
    for text in completions:
        state.add_step(TrajectoryStep(prompt=messages, completion=[{"role": "assistant", "content": text}]))
    return state
