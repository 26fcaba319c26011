"""Do a config's environment and eval names resolve? Found by name, nothing imported or built.

``refractor config check`` runs this after loading the config: a typo in an environment name is
reported there, with the known names, rather than when a run starts. The search is the one a run
makes from the same directory (``refractor envs`` / ``refractor evals`` show it).
"""

from __future__ import annotations

import difflib

from refractor.config.schema import RefractorConfig


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_name_errors(cfg: RefractorConfig) -> list[str]:
    """One line per environment or eval entry whose name matches nothing, listing the known names."""
    from refractor.envs.registry import ENV_PATH_VAR, discover
    from refractor.evals.registry import EVAL_PATH_VAR, discover_evals

    envs = sorted(discover())
    evals = sorted(discover_evals())
    errors = []
    for i, entry in enumerate(cfg.environments):
        if entry.name not in envs:
            errors.append(
                f"config: `environments[{i}].name` = {entry.name!r}: unknown environment"
                f"{_suggest(entry.name, envs)}; known: {', '.join(envs)} "
                f"(more from folders in ${ENV_PATH_VAR} or ./environments)"
            )
    for i, entry in enumerate(cfg.evals):
        if entry.name not in evals and entry.name not in envs:
            errors.append(
                f"config: `evals[{i}].name` = {entry.name!r}: no eval or environment of that name"
                f"{_suggest(entry.name, evals + envs)}; known evals: {', '.join(evals)}; "
                f"environments: {', '.join(envs)} (more from folders in ${EVAL_PATH_VAR} or ./evals)"
            )
    return errors
