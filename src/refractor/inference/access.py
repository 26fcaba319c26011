"""Who may call which route of an inference server; the same rules for both engines.

Three kinds of route:

* **open**: ``/health``, ``/ping``, ``/version``, ``/metrics`` (liveness and scraping).
* **generation**: the OpenAI-style routes (``/v1/...``), ``/inference/v1/generate``, ``/tokenize``,
  ``/detokenize`` and vLLM's other serving routes: they need the API key when the server has one.
* **control**: everything else (pause/resume/abort, the weight-update routes, vLLM's development
  routes such as ``/collective_rpc``, LoRA loading, the API docs): they need the control token,
  and are refused outright on a server started without one.

Deny by default: a route this module does not know is a control route. Credentials travel as
``Authorization: Bearer <secret>`` and are compared in constant time. Servers read them from
environment variables, never from their command line (which every user of the machine can read).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from enum import Enum

CONTROL_TOKEN_ENV = "REFRACTOR_CONTROL_TOKEN"
API_KEY_ENV = "REFRACTOR_API_KEY"
MIN_SECRET_CHARS = 16  # shorter secrets are guessable

_OPEN = frozenset({"/health", "/ping", "/version", "/metrics"})
_GENERATION_EXACT = frozenset(
    {"/tokenize", "/detokenize", "/invocations", "/pooling", "/classify", "/score", "/rerank"}
)
_GENERATION_PREFIXES = ("/v1/", "/v2/", "/inference/", "/cohere/")
# administrative routes that live under a generation prefix
_CONTROL_UNDER_PREFIX = frozenset(
    {"/inference/v1/abort_requests", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
)


class RouteKind(Enum):
    OPEN = "open"
    GENERATION = "generation"
    CONTROL = "control"


def route_kind(path: str) -> RouteKind:
    path = "/" + path.strip("/")
    if path in _OPEN:
        return RouteKind.OPEN
    if path in _CONTROL_UNDER_PREFIX:
        return RouteKind.CONTROL
    if path in _GENERATION_EXACT or path.startswith(_GENERATION_PREFIXES):
        return RouteKind.GENERATION
    return RouteKind.CONTROL


def new_token() -> str:
    """A fresh secret for one run's control routes."""
    return secrets.token_urlsafe(32)


def bearer(secret: str | None) -> dict[str, str]:
    """The header a client sends to present ``secret`` (none when there is no secret)."""
    return {"Authorization": f"Bearer {secret}"} if secret else {}


class _Secret:
    """A secret kept only as its digest, checked in constant time."""

    def __init__(self, value: str):
        self._digest = hashlib.sha256(value.encode()).digest()

    def matches(self, presented: str | None) -> bool:
        if presented is None:
            return False
        return secrets.compare_digest(hashlib.sha256(presented.encode()).digest(), self._digest)


def _presented(scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, param = value.decode("latin-1").partition(" ")
            return param.strip() if scheme.lower() == "bearer" else None
    return None


class AccessGuard:
    """Pure ASGI middleware enforcing the rules above.

    ``control_token=None``: control routes are disabled (403). ``api_key=None``: generation routes
    are open to whoever reaches the port (bind to loopback, or set a key).
    """

    def __init__(self, app, control_token: str | None = None, api_key: str | None = None):
        self.app = app
        self._control = _Secret(control_token) if control_token else None
        self._api_key = _Secret(api_key) if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        refusal = self._refusal(route_kind(path), _presented(scope))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message = refusal
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": {"message": message, "type": "Unauthorized", "code": status}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _refusal(self, kind: RouteKind, presented: str | None) -> tuple[int, str] | None:
        if kind is RouteKind.OPEN:
            return None
        if kind is RouteKind.GENERATION:
            if self._api_key is None or self._api_key.matches(presented):
                return None
            return 401, "this server requires an API key: send `Authorization: Bearer <key>`"
        if self._control is None:
            return 403, (
                "control routes (pause, resume, abort, weight updates) are disabled on this server; "
                "start it with --enable-weight-updates and a control token"
            )
        if self._control.matches(presented):
            return None
        return 401, "control routes need this server's control token: send `Authorization: Bearer <token>`"


class EnvAccessGuard(AccessGuard):
    """``AccessGuard`` configured from the environment (``REFRACTOR_CONTROL_TOKEN``,
    ``REFRACTOR_API_KEY``): the form vLLM's ``--middleware`` option instantiates."""

    def __init__(self, app):
        super().__init__(app, os.environ.get(CONTROL_TOKEN_ENV) or None, os.environ.get(API_KEY_ENV) or None)
