"""Evals: dedicated evals (``evals/<name>/eval.py``) and environments evaluated as they are.

* :class:`~refractor.evals.base.Eval` — write a standalone eval (``load_dataset`` +
  ``compute_eval_metrics``) or wrap an environment (``environment_name``).
* :func:`~refractor.evals.registry.resolve_eval` — a dedicated eval by name, else the environment.
* :mod:`~refractor.evals.passk` — the ``pass_k`` entry, unbiased pass@k / pass^k, aggregation.

Built-ins: ``math500``, ``aime_2024``, ``aime_2025``, ``gpqa_diamond``. Running evals during
training (baseline, every ``eval_every`` steps on dedicated servers, final) is the orchestrator's
job: :mod:`refractor.orchestrator.eval_schedule`.
"""

from refractor.evals.base import DatasetEval, Eval
from refractor.evals.passk import PassKSpec, aggregate, parse_pass_k, pass_at_k, pass_pow_k
from refractor.evals.registry import EVAL_PATH_VAR, discover_evals, list_evals, resolve_eval

__all__ = [
    "EVAL_PATH_VAR",
    "DatasetEval",
    "Eval",
    "PassKSpec",
    "aggregate",
    "discover_evals",
    "list_evals",
    "parse_pass_k",
    "pass_at_k",
    "pass_pow_k",
    "resolve_eval",
]
