"""Finding environments by name: built-ins, folders, and installed packages.

Search order (the first match wins; ``refractor envs`` shows where each name comes from):
1. folders ``<dir>/<name>/environment.py`` for each ``dir`` in ``$REFRACTOR_ENV_PATH`` (``os.pathsep``
   separated) and then ``./environments``;
2. entry points of group ``refractor.environments`` (``name = "pkg.module:Class"`` or ``"pkg.module"``);
3. built-ins (``refractor.envs.builtin.BUILTINS``).

A module may declare ``REQUIRED_PACKAGES`` / ``OPTIONAL_PACKAGES`` (lists of distribution names);
they are read with ``ast`` before import, and missing required packages raise an ImportError with a
``pip install`` hint. The class is chosen unambiguously: the module's ``ENVIRONMENT_CLASS`` (a class
or its name) if set, else the single concrete ``Environment`` subclass *defined in* that module.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from refractor.envs.base import Environment, MultiTurnEnvironment, SingleTurnEnvironment
from refractor.errors import RefractorUserError

ENV_PATH_VAR = "REFRACTOR_ENV_PATH"
ENTRY_POINT_GROUP = "refractor.environments"
DEFAULT_ENV_DIR = "environments"
_BASES = {Environment, SingleTurnEnvironment, MultiTurnEnvironment}
_CLASS_CACHE: dict[tuple[str, str], type[Environment]] = {}


class EnvironmentNotFoundError(RefractorUserError, LookupError):
    pass


@dataclass
class EnvironmentSpec:
    """Where an environment comes from, found without importing it."""

    name: str
    source: Literal["folder", "entry_point", "builtin"]
    location: str  # folder path, or "module:attr" / "module"
    required_packages: list[str] = field(default_factory=list)
    optional_packages: list[str] = field(default_factory=list)

    @property
    def missing_packages(self) -> list[str]:
        return [p for p in self.required_packages if not package_available(p)]

    @property
    def missing_optional_packages(self) -> list[str]:
        return [p for p in self.optional_packages if not package_available(p)]

    def source_file(self) -> Path | None:
        if self.source == "folder":
            return Path(self.location) / "environment.py"
        module = self.location.split(":")[0]
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return None
        return Path(spec.origin) if spec and spec.origin else None


def package_available(requirement: str) -> bool:
    """Is a distribution importable? Accepts ``dist-name``, ``dist-name>=1`` or ``dist:import_name``."""
    dist, _, module = requirement.partition(":")
    for sep in "<>=!~[; ":
        dist = dist.split(sep)[0]
    module = module or dist.replace("-", "_").lower()
    try:
        if importlib.util.find_spec(module) is not None:
            return True
    except (ImportError, ValueError):
        pass
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def declared_packages(path: Path | None) -> tuple[list[str], list[str]]:
    """``REQUIRED_PACKAGES`` and ``OPTIONAL_PACKAGES`` of a module file, read without importing it."""
    if path is None or not path.exists():
        return [], []
    found: dict[str, list[str]] = {"REQUIRED_PACKAGES": [], "OPTIONAL_PACKAGES": []}
    for node in ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        for target in targets:
            if isinstance(target, ast.Name) and target.id in found and node.value is not None:
                try:
                    found[target.id] = [str(p) for p in ast.literal_eval(node.value)]
                except ValueError as err:
                    raise ValueError(f"{path}: {target.id} must be a literal list of strings") from err
    return found["REQUIRED_PACKAGES"], found["OPTIONAL_PACKAGES"]


def search_paths(extra: list[str | Path] | None = None) -> list[Path]:
    """Folders searched for ``<name>/environment.py``.

    In order: ``extra``, ``$REFRACTOR_ENV_PATH``, ``./environments``.
    """
    dirs = [Path(p) for p in (extra or [])]
    dirs += [Path(p) for p in os.environ.get(ENV_PATH_VAR, "").split(os.pathsep) if p]
    dirs.append(Path.cwd() / DEFAULT_ENV_DIR)
    return [d.expanduser().resolve() for d in dirs]


def _with_packages(spec: EnvironmentSpec) -> EnvironmentSpec:
    spec.required_packages, spec.optional_packages = declared_packages(spec.source_file())
    return spec


def discover(extra_paths: list[str | Path] | None = None) -> dict[str, EnvironmentSpec]:
    """Every visible environment by name (first match in search order wins)."""
    from refractor.envs.builtin import BUILTINS

    specs: dict[str, EnvironmentSpec] = {}
    for directory in search_paths(extra_paths):
        if directory.is_dir():
            for folder in sorted(directory.iterdir()):
                if (folder / "environment.py").is_file() and folder.name not in specs:
                    specs[folder.name] = EnvironmentSpec(folder.name, "folder", str(folder))
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        specs.setdefault(ep.name, EnvironmentSpec(ep.name, "entry_point", ep.value))
    for name, target in BUILTINS.items():
        specs.setdefault(name, EnvironmentSpec(name, "builtin", target))
    return {name: _with_packages(spec) for name, spec in specs.items()}


def find_spec(name: str, extra_paths: list[str | Path] | None = None) -> EnvironmentSpec:
    specs = discover(extra_paths)
    if name not in specs:
        where = ", ".join(str(p) for p in search_paths(extra_paths))
        raise EnvironmentNotFoundError(
            f"unknown environment {name!r}. Known: {sorted(specs)}. Folders searched: {where} "
            f"(add one with ${ENV_PATH_VAR}); packages can register entry points in group "
            f"{ENTRY_POINT_GROUP!r}."
        )
    return specs[name]


def _import_folder(spec: EnvironmentSpec) -> Any:
    """Import ``<folder>/environment.py`` as ``refractor_user_env_<name>.environment`` so that
    relative imports of sibling files work."""
    folder = Path(spec.location)
    digest = hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:8]
    package = f"refractor_user_env_{spec.name.replace('-', '_')}_{digest}"
    if package not in sys.modules:
        init = folder / "__init__.py"
        if init.exists():
            pkg_spec = importlib.util.spec_from_file_location(
                package, init, submodule_search_locations=[str(folder)]
            )
        else:
            pkg_spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
            pkg_spec.submodule_search_locations = [str(folder)]
        module = importlib.util.module_from_spec(pkg_spec)
        sys.modules[package] = module
        if init.exists():
            pkg_spec.loader.exec_module(module)
    return importlib.import_module(f"{package}.environment")


def _concrete_env_class(obj: Any) -> bool:
    return (
        inspect.isclass(obj)
        and issubclass(obj, Environment)
        and obj not in _BASES
        and not inspect.isabstract(obj)
    )


def select_class(
    module: Any,
    origin: str,
    is_candidate: Any = None,
    marker: str = "ENVIRONMENT_CLASS",
    kind: str = "Environment",
) -> type:
    """The module's ``marker`` attribute (a class or its name), else its only class that ``is_candidate``
    accepts (defined in the module itself, not imported: an import must never change the choice)."""
    is_candidate = is_candidate or _concrete_env_class
    chosen = getattr(module, marker, None)
    if chosen is not None:
        cls = getattr(module, chosen) if isinstance(chosen, str) else chosen
        if not is_candidate(cls):
            raise TypeError(f"{origin}: {marker}={chosen!r} is not a concrete {kind} subclass")
        return cls
    candidates = [
        obj for obj in vars(module).values() if is_candidate(obj) and obj.__module__ == module.__name__
    ]
    if len(candidates) != 1:
        names = sorted(c.__name__ for c in candidates)
        problem = (
            f"defines no concrete {kind} subclass"
            if not candidates
            else f"defines several {kind} subclasses {names}"
        )
        raise TypeError(f"{origin} {problem}; set {marker} = <the class> in that module")
    return candidates[0]


def load_environment_class(name: str, extra_paths: list[str | Path] | None = None) -> type[Environment]:
    spec = find_spec(name, extra_paths)
    key = (name, spec.location)
    if key in _CLASS_CACHE:
        return _CLASS_CACHE[key]
    missing = spec.missing_packages
    if missing:
        raise ImportError(
            f"environment {name!r} needs packages that are not installed: {missing}. "
            f"Install them with: pip install {' '.join(missing)}"
        )
    if spec.source == "folder":
        cls = select_class(_import_folder(spec), str(spec.source_file()))
    else:
        module_name, _, attr = spec.location.partition(":")
        module = importlib.import_module(module_name)
        cls = getattr(module, attr) if attr else select_class(module, module_name)
        if not _concrete_env_class(cls):
            raise TypeError(f"{spec.location} (environment {name!r}) is not a concrete Environment subclass")
    _CLASS_CACHE[key] = cls
    return cls


def get_environment(name: str, extra_paths: list[str | Path] | None = None, **kwargs: Any) -> Environment:
    """Instantiate environment ``name`` with constructor ``kwargs``; ``env.name`` is ``name`` unless
    the class defines its own ``name``."""
    cls = load_environment_class(name, extra_paths)
    try:
        env = cls(**kwargs)
    except TypeError as err:
        raise TypeError(f"environment {name!r} ({cls.__name__}): bad kwargs {sorted(kwargs)}: {err}") from err
    if getattr(env, "_name", None) is None:
        env._name = name
    return env


def list_environments(extra_paths: list[str | Path] | None = None) -> list[str]:
    return sorted(discover(extra_paths))
