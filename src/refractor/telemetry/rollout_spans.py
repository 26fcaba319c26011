"""Rollout lifecycle spans as typed rows: the ``generation``, ``env_response`` and ``reward`` spans of
every rollout (docs/metrics.md#rollout-lifecycle-spans) are most of a run's timeline, so the run store
keeps them in ``rollout_spans`` (a kind number, the times, one column per known attribute) instead of
``events`` rows with JSON attributes, in under a third of the bytes. Readers get them back as events
of component ``rollout`` with the same names and attributes, through :func:`events_select`.

Latencies are stored as whole microseconds (an integer takes 2-4 bytes, a float 8). An attribute
without a column of its type goes to ``extra`` (JSON), so nothing is lost; an attribute whose value
is null is left out. A span's id in a reader's answer is the negative of its row id, so it never
equals an event's.
"""

from __future__ import annotations

import json
from typing import Any

from refractor.records import TimelineEvent

COMPONENT = "rollout"
KINDS = ("generation", "env_response", "reward")  # kind = index: 0 and 1 take no bytes in a row

# (column, the type stored in it: a float column holds microseconds); bool is tested first, as it is
# also an int
COLUMNS = (
    ("rollout_id", int),
    ("group_id", int),
    ("sample", int),
    ("turn", int),
    ("server", str),
    ("lane", int),
    ("finish_reason", str),
    ("completion_tokens", int),
    ("queue_time", float),
    ("ttft", float),
    ("prefill_time", float),
    ("decode_time", float),
    ("e2e_latency", float),
    ("ok", bool),
    ("outcome", str),
)

# the condition of the partial index rollout_spans_long (store.SCHEMA): the spans a zoomed-out timeline
# can show (the dashboard asks a window of over 1800 s for spans of a 1500th of it), found without
# reading the short ones
LONG_SECONDS = 1.0
LONG = f'"end" - start >= {LONG_SECONDS}'

INSERT = (
    'INSERT INTO rollout_spans (kind, step, start, "end", '
    + ", ".join(c for c, _ in COLUMNS)
    + ", extra) VALUES ("
    + ",".join("?" * (len(COLUMNS) + 5))
    + ")"
)


def is_rollout_span(event: TimelineEvent) -> bool:
    return event.component == COMPONENT and event.name in KINDS


def _fits(value: Any, kind: type) -> bool:
    if isinstance(value, bool) or kind is bool:
        return isinstance(value, bool) and kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def _stored(value: Any, kind: type) -> Any:
    if kind is bool:
        return int(value)
    return round(value * 1e6) if kind is float else value


def span_row(event: TimelineEvent, step: int | None) -> tuple:
    """The ``rollout_spans`` row of one lifecycle span (``INSERT``'s parameters)."""
    attrs = dict(event.attrs)
    values = []
    for column, kind in COLUMNS:
        value = attrs.get(column)
        if value is not None and _fits(value, kind):
            values.append(_stored(value, kind))
            del attrs[column]
        else:
            values.append(None)
    step = attrs.pop("step", step)
    extra = {k: v for k, v in attrs.items() if v is not None}
    extra_text = json.dumps(extra, default=str, ensure_ascii=False, separators=(",", ":")) if extra else None
    return (KINDS.index(event.name), step, event.start, event.end, *values, extra_text)


def _value(column: str, kind: type) -> str:
    if kind is bool:
        return f"CASE {column} WHEN 1 THEN json('true') WHEN 0 THEN json('false') END"
    return f"{column} / 1e6" if kind is float else column


_NAME = "CASE kind " + " ".join(f"WHEN {i} THEN '{name}'" for i, name in enumerate(KINDS)) + " END"
_ATTRS = (
    "json_patch(json_patch('{}', json_object("
    + ", ".join(f"'{c}', {_value(c, kind)}" for c, kind in COLUMNS)
    + ")), coalesce(extra, '{}'))"
)


def events_select(where: str, index: str | None = None) -> str:
    """A SELECT of the spans matching ``where`` (over ``rollout_spans``' columns) in the events
    table's columns: ``id, name, component, step, start, "end", attrs`` (attrs as JSON text),
    read by ``index`` when given."""
    indexed = f" INDEXED BY {index}" if index else ""
    return (
        f"SELECT -id AS id, {_NAME} AS name, '{COMPONENT}' AS component, step, start, \"end\", "
        f"{_ATTRS} AS attrs FROM rollout_spans{indexed} WHERE {where}"
    )
