"""The orchestrator: prompts -> lanes on inference servers -> rollouts -> groups -> training batches.

Entry point (all dependencies injected, so Ray actors, HTTP clients or test fakes plug in)::

    settings = OrchestratorSettings.from_config(cfg)
    orch = Orchestrator(settings, envs, servers, trainer, store, tokenizer, sinks=[ConsoleSink(...)])
    orch.load_state_dict(saved)          # optional: resume (counters + prompt stream)
    await orch.run()                     # trains cfg.number_of_steps steps

* ``servers``: objects with ``name`` and ``async generate(token_ids, sampling: Sampling) -> result``
  where ``result`` has ``token_ids``, ``logprobs``, ``finish_reason``, ``weight_versions``.
* ``trainer``: :class:`~refractor.orchestrator.protocols.Trainer` (``train_step``,
  ``update_weights(version, target)``, ``save_checkpoint(step, orchestrator_state)``).
* ``store``: :class:`refractor.telemetry.store.RunStore` (or anything with its ``log_*`` methods).

The :class:`Orchestrator` (train loop, checkpoints, the eval host) composes a
:class:`~refractor.orchestrator.dispatch.Dispatcher` (lanes, groups in flight, their samples,
cancellation). Pure pieces, testable alone: :mod:`.lanes` (LaneManager), :mod:`.async_gate`
(async gate, off-policy cancellation, checkpoint gating), :mod:`.prompts` (seeded checkpointable
prompt stream and prefetch), :mod:`.batching` (acceptance test and batch cutting), :mod:`.chat`
(token-exact multi-turn prompts). The records they pass around (Rollout, Group, ...) live in
:mod:`refractor.records`.
"""

from refractor.inference.client import Sampling
from refractor.orchestrator.orchestrator import Orchestrator
from refractor.orchestrator.protocols import StepSink, Trainer
from refractor.orchestrator.rollout import InferenceServer
from refractor.orchestrator.settings import OrchestratorSettings
from refractor.records import DiscardReason, Group, Rollout, RolloutStatus, to_train_samples

__all__ = [
    "DiscardReason",
    "Group",
    "InferenceServer",
    "Orchestrator",
    "OrchestratorSettings",
    "Rollout",
    "RolloutStatus",
    "Sampling",
    "StepSink",
    "Trainer",
    "to_train_samples",
]
