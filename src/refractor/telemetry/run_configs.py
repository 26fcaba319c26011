"""Runs' resolved configs side by side: flattening to dotted keys, the keys two configs differ
in, and matching a run's config against a ``key=value,key=value`` query."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "l": [{"x": 2}]}`` -> ``{"a.b": 1, "l.0.x": 2}`` (empty containers kept)."""
    if isinstance(config, dict) and config:
        items = config.items()
    elif isinstance(config, list) and config:
        items = ((str(i), v) for i, v in enumerate(config))
    else:
        return {prefix: config} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in items:
        out |= flatten(value, f"{prefix}.{key}" if prefix else str(key))
    return out


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """The dotted keys whose values differ, sorted, each with both values (None when absent)."""
    fa = flatten(a)
    fb = flatten(b)
    return [
        {"key": k, "a": fa.get(k), "b": fb.get(k), "only": "a" if k not in fb else "b" if k not in fa else ""}
        for k in sorted(fa.keys() | fb.keys())
        if fa.get(k) != fb.get(k) or (k in fa) != (k in fb)
    ]


@dataclass(frozen=True)
class ConfigQuery:
    terms: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, text: str) -> ConfigQuery:
        """``learning_rate=1e-6, loss_type=grpo``; a key may be a dotted path (``environments.0.name``)
        or a last component (``name`` matches any key ending in ``.name``)."""
        terms = []
        for part in text.split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"search term {part.strip()!r} is not key=value")
            terms.append((key.strip(), value.strip()))
        if not terms:
            raise ValueError("empty search: write key=value pairs separated by commas")
        return cls(tuple(terms))

    def matches(self, config: dict[str, Any]) -> bool:
        flat = flatten(config)
        return all(
            any(_same(v, value) for k, v in flat.items() if k == key or k.endswith("." + key))
            for key, value in self.terms
        )


def _same(stored: Any, wanted: str) -> bool:
    """A stored value equals the typed text: numbers by value (1e-6 == 0.000001), booleans and
    null by their YAML/JSON spelling, strings exactly."""
    if isinstance(stored, bool) or stored is None:
        return wanted.lower() == json.dumps(stored) or (stored is True and wanted.lower() in ("true", "yes"))
    if isinstance(stored, int | float):
        try:
            return float(wanted) == float(stored)
        except ValueError:
            return False
    return str(stored) == wanted
