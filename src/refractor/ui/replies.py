"""Small pieces of the API's routes: answers encoded with the C JSON encoder, list parameters,
input checks that answer 400, and the series shape of per-step answers."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException, Response

from refractor.telemetry import derived, rollout_query
from refractor.telemetry.query import RunReader

MAX_NAMES = 400


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def json_reply(fn: Callable[..., Any]) -> Callable[..., Response]:
    """Encode a route's answer with the C JSON encoder directly (FastAPI's generic encoder is
    ~10x slower on the large answers of this API); infinities become null, as JSON has none."""

    @functools.wraps(fn)
    def route(*args: Any, **kwargs: Any) -> Response:
        value = fn(*args, **kwargs)
        return Response(value if isinstance(value, bytes) else encode(value), media_type="application/json")

    return route


def encode(value: Any) -> bytes:
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(value), separators=(",", ":"))
    return text.encode()


def split(text: str | None) -> list[str]:
    return [p for p in (text or "").split(",") if p]


def as_series(by_step: dict[int, dict[str, float]]) -> dict[str, dict[str, list[Any]]]:
    """{step: {name: value}} -> {name: {"steps": [...], "values": [...]}} (steps where it is defined)."""
    out: dict[str, dict[str, list[Any]]] = {}
    for step, metrics in by_step.items():
        for name, value in metrics.items():
            series = out.setdefault(name, {"steps": [], "values": []})
            series["steps"].append(step)
            series["values"].append(value)
    return dict(sorted(out.items()))


def has_rows(r: RunReader, table: str, where: str = "1") -> bool:
    return r.has_table(table) and bool(r.rows(f"SELECT 1 AS x FROM {table} WHERE {where} LIMIT 1"))


def check_field(field: str) -> None:
    if field not in derived.DISTRIBUTION_FIELDS:
        raise HTTPException(400, f"field must be one of {', '.join(derived.DISTRIBUTION_FIELDS)}")


def check_statuses(statuses: list[str]) -> None:
    bad = [s for s in statuses if s not in rollout_query.STATUSES]
    if bad:
        raise HTTPException(400, f"unknown status {bad[0]!r}: one of {', '.join(rollout_query.STATUSES)}")


def check_window(start: float, end: float) -> None:
    if not (end > start) or end - start > 366 * 86400:
        raise HTTPException(400, "the time window needs start < end, at most a year apart")
