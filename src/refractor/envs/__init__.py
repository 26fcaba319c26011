"""Environments: datasets, prompts, multi-turn logic and rewards, with Telescope's environment API
(docs/config.md#telescope-compatibility; the turn protocol: docs/architecture.md#seams).

Writing an environment
----------------------
Subclass ``SingleTurnEnvironment`` (``compute_reward(completion, sample, eos_token)``),
``MultiTurnEnvironment`` (``env_response(messages, state)``, ``is_done(state)``,
``compute_reward(state, eos_token)``) or ``ToolEnvironment`` (tools are plain Python functions),
implement ``load_dataset(num_samples=-1) -> list[Sample]`` (set ``self._samples``), and put the
file at ``environments/<name>/environment.py`` (or any folder on ``$REFRACTOR_ENV_PATH``, or an
entry point in group ``refractor.environments``). ``refractor envs`` lists what is visible.

Telescope compatibility: replace the package prefix ``telescope.environments`` by
``refractor.envs``; nothing else changes:

=====================================  ======================================
Telescope                              refractor
=====================================  ======================================
``telescope.environments.base``        ``refractor.envs.base``
``telescope.environments.tool_env``    ``refractor.envs.tool_env``
``telescope.environments.parsers``     ``refractor.envs.parsers``
``telescope.environments.rewards``     ``refractor.envs.rewards``
``telescope.environments.registry``    ``refractor.envs.registry``
``telescope.environments._sandbox``    ``refractor.envs.sandbox``
=====================================  ======================================

Built-in environment names are the config names (``hendrycks_math``, not ``hendrycks-math``), so
name-keyed features (eval-sample exclusion) work for every environment.

Driving an environment (the orchestrator's contract)
----------------------------------------------------
One code path for every environment; a single-turn environment is one turn of it::

    env = get_environment(entry.name, **entry.kwargs)     # registry; kwargs are constructor kwargs
    env.reward_min, env.reward_max = entry.reward_min, entry.reward_max   # when set in the config
    samples = env.samples                                 # loads once: env.load_dataset()
    await env.prepare_resources()                         # pre-warm sandboxes etc. (may be slow)

    state = env.create_initial_state(sample)              # RolloutState(sample, env_name=env.name)
    messages = env.get_initial_prompt(sample)             # list of {"role", "content"} dicts
    while True:
        prompt_text = env.render_prompt(messages, tokenizer, chat_template_kwargs)  # turn 0, or any
        #  non-interleaved turn; a trailing assistant message (thinking prefix) is continued.
        ... generate -> text, token ids, logprobs, finish_reason ...
        completion = [{"role": "assistant", "content": text}]
        state.add_step(TrajectoryStep(prompt=messages, completion=completion, prompt_token_ids=...,
                                      completion_token_ids=..., completion_logprobs=...,
                                      is_truncated=finish_reason == "length", finish_reason=finish_reason))
        env_msgs = await env.env_response(messages + completion, state)   # may mutate state.custom
        tool_calls = state.pop_pending_tool_calls()      # list[ToolCallRecord] for logging
        done, reason = env.is_done(state)                # called after env_response
        if done:
            state.is_completed, state.stop_reason = True, reason   # env_msgs are discarded
            break
        messages = env.get_next_prompt_messages(state, env_msgs)   # prompt + completion + env_msgs
        # interleaved mode: tokenize only env_msgs (each may carry "turn_type") and append to the ids

    outcome = await score_rollout(env, state, eos_token=tokenizer.eos_token, timeout_s=cfg.reward_timeout_s)
    # outcome.result: RewardResult(total_reward, sample_metrics, golden_answers, info_turns, sample_tags)
    # or outcome.result is None: outcome.reason (a DiscardReason) says why the rollout is discarded,
    # outcome.detail what happened (outcome.reward_or_zero() gives a logged zero result).
    eval_outcome = await score_rollout(env, state, ..., eval_mode=True)   # -> EvalMetricsResult
    ...
    await env.close()                                     # once, at shutdown

``env.score(state)`` hides the reward signature difference (single-turn envs receive the last
completion text and the sample; multi-turn envs the state). Completions are passed as text; the
trailing ``eos_token`` string is stripped by rubric-based rewards. ``env.describe()`` gives the
``env_details`` record (name, is_multi_turn, dataset_size, max_turns, metrics_ranges, tags_options).
"""

from refractor.envs.base import (
    Environment,
    MultiTurnEnvironment,
    SingleTurnEnvironment,
    strip_eos,
)
from refractor.envs.registry import discover, get_environment, list_environments, load_environment_class
from refractor.envs.rewards import Rubric
from refractor.envs.runners import run_blocking
from refractor.envs.scoring import ScoreOutcome, score_rollout
from refractor.envs.tool_env import ToolEnvironment
from refractor.records import (
    ChatMessage,
    EvalMetricsResult,
    Messages,
    RewardResult,
    RolloutState,
    Sample,
    ToolCallRecord,
    TrajectoryStep,
    info_turn,
)

__all__ = [
    "ChatMessage",
    "Environment",
    "EvalMetricsResult",
    "Messages",
    "MultiTurnEnvironment",
    "RewardResult",
    "RolloutState",
    "Rubric",
    "Sample",
    "ScoreOutcome",
    "SingleTurnEnvironment",
    "ToolCallRecord",
    "ToolEnvironment",
    "TrajectoryStep",
    "discover",
    "get_environment",
    "info_turn",
    "list_environments",
    "load_environment_class",
    "run_blocking",
    "score_rollout",
    "strip_eos",
]
