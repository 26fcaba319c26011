"""vLLM's ``/pause`` held to refractor's pause rule: a pause while paused changes nothing.

vLLM 0.32 keeps one pause state per engine (not a count: one ``/resume`` ends it, a resume while
running does nothing, as on the native engine) and answers ``/pause`` once the engine is idle. But a
``wait`` pause on an engine paused in ``keep`` mode switches it to vLLM's draining state: the
requests frozen by the keep pause run to their end, and only then does the call answer. The keep
pause silently stops holding, and the call lasts as long as the longest frozen request. This
middleware answers that call at once instead and leaves the pause as it is (nothing runs while
paused, so there is nothing to wait for), as the native engine does. A ``wait`` pause while another
one is still draining goes to vLLM, which answers both when the drain ends.

Where vLLM still differs from the native engine: a ``/resume`` during a ``wait`` drain ends the pause
at once, but vLLM answers the draining ``wait`` call only when the engine is next idle (on a busy
server, possibly much later). refractor's own control plane pauses with ``keep`` only, one pause per
update, so it never depends on that case.

Installed by the launcher as a ``--middleware`` inside refractor's access guard, which authenticates
every call first.
"""

from __future__ import annotations

import json
from urllib.parse import parse_qs

_PAUSED = json.dumps({"status": "paused"}, separators=(",", ":")).encode()  # as vLLM answers it
_PAUSED_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(_PAUSED)).encode())]


class VllmPauseGuard:
    """Pure ASGI middleware; vLLM instantiates it with its app (``--middleware``)."""

    def __init__(self, app):
        self.app = app
        self._draining = 0  # wait pauses handed to vLLM that have not answered yet

    async def __call__(self, scope, receive, send) -> None:
        if not _is_wait_pause(scope):
            await self.app(scope, receive, send)
            return
        engine = scope["app"].state.engine_client
        if self._draining == 0 and await engine.is_paused():
            await send({"type": "http.response.start", "status": 200, "headers": _PAUSED_HEADERS})
            await send({"type": "http.response.body", "body": _PAUSED})
            return
        self._draining += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._draining -= 1


def _is_wait_pause(scope) -> bool:
    if scope["type"] != "http" or scope.get("method") != "POST":
        return False
    if scope["path"].removeprefix(scope.get("root_path", "")).rstrip("/") != "/pause":
        return False
    return parse_qs(scope.get("query_string", b"").decode("latin-1")).get("mode") == ["wait"]
