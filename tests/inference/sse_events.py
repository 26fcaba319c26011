"""The JSON payloads of a streamed (server-sent events) response, for the tests of this folder
(imported as ``sse_events``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx


def data_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """Each ``data: {...}`` event's JSON, in order (``data: [DONE]`` and other events are skipped).
    Events end with a blank line; ``iter_lines`` is not used, since it also splits at characters such
    as U+2028 that a server writing JSON without ASCII escapes (vLLM) leaves raw inside an event."""
    pending = b""
    for data in response.iter_bytes():
        *events, pending = (pending + data).split(b"\n\n")
        for event in events:
            if event.startswith(b"data: {"):
                yield json.loads(event.removeprefix(b"data: "))
