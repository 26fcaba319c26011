"""Config layers: in-code defaults -> ``--config FILE`` -> ``--key value`` overrides.

Every user mistake becomes one :class:`ConfigError` whose message names the key, where it came
from (file or command line), the bad value and what is allowed. No traceback reaches the user.
"""

from __future__ import annotations

import difflib
import re
import sys
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from refractor.config.schema import IGNORED_KEYS, SECTIONS, EnvironmentEntry, EvalEntry, RefractorConfig
from refractor.errors import RefractorUserError


class ConfigError(RefractorUserError, ValueError):
    """A configuration the user must fix. ``str(err)`` is the full, human-readable message."""


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names one key twice (YAML would silently keep the last value)."""


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-6`` as a string; accept it as a float like every other tool does.

    A key given twice in one mapping is an error naming both lines, not a silent override.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(f"key `{key}` appears twice, on lines {seen[key]} and {line}")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_FLOAT = re.compile(
    r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"
)
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def parse_yaml_value(text: str) -> Any:
    """Parse one CLI value as a YAML scalar, list or dict.

    Examples: ``3``, ``1e-6``, ``true``, ``null``, ``[a, b]``.
    """
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text
    if value is None and text.strip() not in ("null", "~"):
        return text  # `--ray_address ""` means the empty string, not null
    return value


# Aliases let a few lines of YAML stand for an exponentially large document ("billion laughs");
# a run config has a few hundred values, so anything far beyond that is refused before it is built.
MAX_YAML_VALUES = 100_000


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """Values the document holds once every alias is expanded (shared nodes counted per use)."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a recursive alias counts once here; yaml refuses recursion when building
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    else:
        size = 1
    memo[id(node)] = size
    return size


def read_yaml_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p} (cwd: {Path.cwd()})")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{p}: not a text (UTF-8) file: byte {err.start} cannot be decoded") from None
    except OSError as err:
        raise ConfigError(f"{p}: cannot be read: {err.strerror}") from None
    try:
        loader = _Loader(text)
        try:
            root = loader.get_single_node()
            if root is not None and _expanded_size(root, {}) > MAX_YAML_VALUES:
                raise ConfigError(
                    f"{p}: expands to more than {MAX_YAML_VALUES:,} values through YAML aliases; "
                    "a run config is a flat mapping of keys to values"
                )
            data = loader.construct_document(root) if root is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{p}: a config file must be a mapping of keys to values, got {type(data).__name__}"
        )
    return data


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``--key value`` / ``--key=value`` / ``--flag`` (true) -> {key: parsed value}.

    Dashes in keys become underscores.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("--") or tok == "--":
            raise ConfigError(f"command line: expected `--key value`, got `{tok}`")
        body = tok[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
            i += 1
        elif i + 1 < len(args) and not (args[i + 1].startswith("--") and len(args[i + 1]) > 2):
            key = body
            raw = args[i + 1]
            i += 2
        else:  # a bare flag: only a true/false key may omit its value
            key = body
            raw = "true"
            i += 1
            name = key.replace("-", "_").lower()
            if name in RefractorConfig.model_fields and not _is_bool_key(name):
                raise ConfigError(
                    f"command line: `--{body}` needs a value (`--{body} VALUE` or `--{body}=VALUE`); "
                    "only true/false keys can be given as a bare flag"
                )
        key = key.replace("-", "_").lower()
        out[key] = parse_yaml_value(raw)
    return out


def _is_bool_key(name: str) -> bool:
    annotation = RefractorConfig.model_fields[name].annotation
    return annotation is bool or set(typing.get_args(annotation)) == {bool, type(None)}


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Recursive merge: dicts merge, everything else (lists included) is replaced."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


_NESTED = {"environments": EnvironmentEntry, "evals": EvalEntry}


def _suggest(key: str, candidates=RefractorConfig.model_fields) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _check_unknown(layer: dict[str, Any], source: str) -> list[str]:
    return [
        f"{source}: unknown key `{k}`{_suggest(k)}" for k in layer if k not in RefractorConfig.model_fields
    ]


def _format_validation(err: ValidationError, sources: dict[str, str]) -> list[str]:
    msgs = []
    for item in err.errors():
        loc = item.get("loc", ())
        if not loc:  # a model-level (cross-field) rule: one line per broken rule
            text = item["msg"].removeprefix("Value error, ")
            msgs.extend(f"config: {line}" for line in text.splitlines())
            continue
        key = str(loc[0])
        path = key + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
        where = sources.get(key, "defaults")
        value = item.get("input")
        shown = "" if isinstance(value, dict) and item["type"] != "dict_type" else f" = {value!r}"
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            nested = _NESTED.get(key)
            msg = "unknown key" + (
                _suggest(str(loc[-1]), nested.model_fields) if nested and len(loc) == 3 else ""
            )
            shown = ""
        msgs.append(f"{where}: `{path}`{shown}: {msg}")
    return msgs


def build_config(layers: list[tuple[str, dict[str, Any]]]) -> RefractorConfig:
    """Validate merged layers [(source name, mapping), ...] into a frozen config."""
    errors: list[str] = []
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, layer in layers:
        errors += _check_unknown(layer, source)
        merged = merge(merged, layer)
        sources.update({k: source for k in layer})
    if errors:
        raise ConfigError("\n".join(errors))
    try:
        cfg = RefractorConfig.model_validate(merged)
    except ValidationError as err:
        raise ConfigError("\n".join(_format_validation(err, sources))) from None
    cfg._user_keys = frozenset(sources)
    return cfg


def load_config(
    config_path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None
) -> RefractorConfig:
    """The full resolution used by every entry point (CLI, train.py, tests)."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if config_path is not None:
        layers.append((str(config_path), read_yaml_file(config_path)))
    if overrides:
        parsed = overrides if isinstance(overrides, dict) else parse_overrides(list(overrides))
        layers.append(("command line", parsed))
    cfg = build_config(layers)
    for line in ignored_key_notices(cfg):
        print(line, file=sys.stderr)
    return cfg


def ignored_key_notices(cfg: RefractorConfig) -> list[str]:
    return [
        f"note: `{k}` is accepted for Telescope compatibility but has no effect: {IGNORED_KEYS[k]}"
        for k in sorted(cfg.user_keys & IGNORED_KEYS.keys())
    ]


def config_to_dict(cfg: RefractorConfig) -> dict[str, Any]:
    """JSON-safe dict, keys in the documented section order (as in configs/defaults.yaml)."""
    data = cfg.model_dump(mode="json")
    return {name: data[name] for _, section in SECTIONS for name in section.model_fields}


def config_to_yaml(cfg: RefractorConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None, width=110)


def config_from_dict(data: dict[str, Any]) -> RefractorConfig:
    """Rebuild a config handed to another process (validated again; no notices printed).

    ``user_keys`` is not part of the serialized form; pickling (Ray) keeps it.
    """
    cfg = build_config([("serialized config", data)])
    cfg._user_keys = frozenset()
    return cfg
