"""Finding evals by name: dedicated evals first, environments as the fallback
(docs/orchestrator.md#loading).

A dedicated eval is a folder ``<dir>/<name>/eval.py``. Search order (first match wins):
``$REFRACTOR_EVAL_PATH`` (``os.pathsep`` separated), ``./evals``, then the built-ins shipped in
``refractor/evals/builtin/<name>/eval.py`` (math500, aime_2024, aime_2025, gpqa_diamond). The class
is the module's ``EVAL_CLASS`` (a class or its name) if set, else the single concrete ``Eval``
subclass defined in that module, never the first one in ``dir()`` order, which changes when
another eval class is imported (docs/config.md#deliberate-differences). ``REQUIRED_PACKAGES`` are
checked before import, as for environments.

Any other name is resolved as an environment (``refractor.envs.get_environment``), so every
training environment can be evaluated with its own ``compute_eval_metrics``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from refractor.envs.base import Environment
from refractor.envs.registry import (
    EnvironmentNotFoundError,
    declared_packages,
    get_environment,
    package_available,
    select_class,
)
from refractor.evals.base import DatasetEval, Eval

EVAL_PATH_VAR = "REFRACTOR_EVAL_PATH"
DEFAULT_EVAL_DIR = "evals"
BUILTIN_DIR = Path(__file__).parent / "builtin"
_BASES = {Eval, DatasetEval}


@dataclass(frozen=True)
class EvalSpec:
    name: str
    source: Literal["folder", "builtin"]
    folder: Path

    @property
    def source_file(self) -> Path:
        return self.folder / "eval.py"

    @property
    def missing_packages(self) -> list[str]:
        required, _ = declared_packages(self.source_file)
        return [p for p in required if not package_available(p)]


def eval_search_paths(extra: list[str | Path] | None = None) -> list[Path]:
    dirs = [Path(p) for p in (extra or [])]
    dirs += [Path(p) for p in os.environ.get(EVAL_PATH_VAR, "").split(os.pathsep) if p]
    dirs.append(Path.cwd() / DEFAULT_EVAL_DIR)
    return [d.expanduser().resolve() for d in dirs]


def discover_evals(extra_paths: list[str | Path] | None = None) -> dict[str, EvalSpec]:
    """Every dedicated eval visible from here, by name."""
    specs: dict[str, EvalSpec] = {}
    for source, directories in (("folder", eval_search_paths(extra_paths)), ("builtin", [BUILTIN_DIR])):
        for directory in directories:
            if not directory.is_dir():
                continue
            for folder in sorted(directory.iterdir()):
                if (folder / "eval.py").is_file() and folder.name not in specs:
                    specs[folder.name] = EvalSpec(folder.name, source, folder)  # type: ignore[arg-type]
    return specs


def _import(spec: EvalSpec) -> Any:
    if spec.source == "builtin":
        return importlib.import_module(f"refractor.evals.builtin.{spec.name}.eval")
    # a private package per folder, so that the eval's relative imports of sibling files work
    digest = hashlib.sha1(str(spec.folder).encode()).hexdigest()[:8]
    package = f"refractor_user_eval_{spec.name.replace('-', '_')}_{digest}"
    if package not in sys.modules:
        module_spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        module_spec.submodule_search_locations = [str(spec.folder)]
        sys.modules[package] = importlib.util.module_from_spec(module_spec)
    return importlib.import_module(f"{package}.eval")


def _concrete_eval(obj: Any) -> bool:
    return (
        inspect.isclass(obj) and issubclass(obj, Eval) and obj not in _BASES and not inspect.isabstract(obj)
    )


def load_eval_class(spec: EvalSpec) -> type[Eval]:
    missing = spec.missing_packages
    if missing:
        raise ImportError(
            f"eval {spec.name!r} needs packages that are not installed: {missing}. "
            f"Install them with: pip install {' '.join(missing)}"
        )
    return select_class(
        _import(spec), str(spec.source_file), _concrete_eval, marker="EVAL_CLASS", kind="Eval"
    )


def resolve_eval(name: str, extra_paths: list[str | Path] | None = None, **kwargs: Any) -> Environment:
    """The dedicated eval ``name`` if there is one, else the environment ``name``, built with ``kwargs``."""
    specs = discover_evals(extra_paths)
    spec = specs.get(name)
    if spec is None:
        try:
            return get_environment(name, **kwargs)
        except EnvironmentNotFoundError as err:
            where = ", ".join(str(p) for p in eval_search_paths(extra_paths))
            raise EnvironmentNotFoundError(
                f"unknown eval {name!r}: no dedicated eval (known: {sorted(specs)}; "
                f"folders searched: {where}, add one with ${EVAL_PATH_VAR}) "
                f"and no environment of that name ({err})"
            ) from None
    cls = load_eval_class(spec)
    try:
        instance = cls(**kwargs)
    except TypeError as err:
        raise TypeError(f"eval {name!r} ({cls.__name__}): bad kwargs {sorted(kwargs)}: {err}") from err
    if instance._name is None:
        instance._name = name
    return instance


def list_evals(extra_paths: list[str | Path] | None = None) -> list[str]:
    return sorted(discover_evals(extra_paths))
