"""The orchestrator's typed settings, read once from the run config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from refractor.algorithms.advantages import AdvantageSettings
from refractor.algorithms.filters import FilterSettings
from refractor.orchestrator.rollout import RolloutSettings


@dataclass(frozen=True)
class OrchestratorSettings:
    number_of_steps: int
    group_size: int
    prompts_batch_size_for_trainer: int
    max_concurrent_prompts_per_server: int
    max_async_rollout: int
    max_off_policy_steps: int  # -1: never cancel for staleness
    checkpoint_every: int | bool
    deterministic_rollouts: bool
    discard_group_zero_advantage: bool
    dispatch_only_needed_groups: bool
    individual_sample_lanes: bool
    free_lane_after_generation: bool
    serialize_generation: bool
    enable_thinking: bool
    seed: int
    prompt_prefetch_buffer_size: int  # 0: prompts are prepared when a group needs one
    # await every environment's prepare_resources() before the first rollout; false: they run beside it
    eager_prepare_resources: bool
    rollout: RolloutSettings  # its eos_token is the tokenizer's, filled in by the orchestrator
    advantages: AdvantageSettings
    filters: FilterSettings
    # servers sleep while the trainer steps, at this level (inference_sleep_during_training); None: never
    inference_sleep_level: int | None = None
    # the training loop ends after the step during which this many seconds ran out; None: never
    max_train_seconds: float | None = None
    env_weights: dict[str, float] = field(default_factory=dict)  # environment -> sampling weight
    reward_ranges: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: Any, colocated: bool = False) -> OrchestratorSettings:
        """``colocated``: the run's placement shares GPUs (it decides whether servers sleep)."""
        return cls(
            number_of_steps=cfg.number_of_steps,
            group_size=cfg.group_size,
            prompts_batch_size_for_trainer=cfg.prompts_batch_size_for_trainer,
            max_concurrent_prompts_per_server=cfg.max_concurrent_prompts_per_server,
            max_async_rollout=cfg.max_async_rollout,
            max_off_policy_steps=cfg.max_off_policy_steps,
            checkpoint_every=cfg.checkpoint_every,
            deterministic_rollouts=cfg.deterministic_rollouts,
            discard_group_zero_advantage=cfg.discard_group_zero_advantage,
            dispatch_only_needed_groups=cfg.dispatch_only_needed_groups,
            individual_sample_lanes=cfg.enable_individual_sample_lanes,
            free_lane_after_generation=cfg.free_lane_after_generation,
            serialize_generation=cfg.serialize_generation,
            enable_thinking=cfg.enable_thinking,
            seed=cfg.seed,
            prompt_prefetch_buffer_size=cfg.prompt_prefetch_buffer_size if cfg.enable_prompt_prefetch else 0,
            eager_prepare_resources=cfg.eager_prepare_resources,
            rollout=RolloutSettings.from_config(cfg, eos_token=""),
            advantages=AdvantageSettings.from_config(cfg),
            filters=FilterSettings.from_config(cfg),
            inference_sleep_level=cfg.inference_sleep_level
            if cfg.sleeps_during_training(colocated)
            else None,
            max_train_seconds=cfg.max_train_minutes * 60 if cfg.max_train_minutes else None,
            env_weights={e.name: e.weight for e in cfg.environments},
            reward_ranges={e.name: (e.reward_min, e.reward_max) for e in cfg.environments},
        )

    @property
    def lanes_per_server(self) -> int:
        return self.max_concurrent_prompts_per_server * self.group_size
