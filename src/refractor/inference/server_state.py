"""What the server's routes share: the per-app ``ServerState``, the 400/404 error, the disconnect guard.

``server.py`` (the app and its control routes) and ``routes_openai.py`` (the generation routes) both
build on this module; neither imports the other's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from refractor.inference.engine.async_engine import AsyncLLMEngine
from refractor.inference.server_metrics import ServerMetrics

T = TypeVar("T")


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    chat_template: str | None
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    active_request_ids: set[str] = field(default_factory=set)
    # tokenization and chat templates run here, never on the event loop: a 10 MB prompt takes
    # seconds, during which /health and every other request must still be answered. One thread:
    # a tokenizer is not safe to call from several threads at once.
    _tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    )

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` (tokenizer work) on the tokenizer thread and await its result."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, functools.partial(fn, *args, **kwargs))

    def matching_ids(self, external_ids: Iterable[str]) -> list[str]:
        """Engine request ids for vLLM-style external ids, or for the caller's bare ``request_id``."""
        found = []
        for rid in external_ids:
            for active in list(self.active_request_ids):
                if (
                    active == rid
                    or active in (f"chatcmpl-{rid}", f"generate-tokens-{rid}")
                    or active.startswith(f"cmpl-{rid}-")
                ):
                    found.append(active)
        return found


class BadRequest(ValueError):
    """A request the server refuses: 400, or the 4xx given (404 for unknown models, 409 for a
    weight-update call out of order)."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.status = status


def invalid_request(errors: Iterable[Any]) -> str:
    """One line naming each invalid field of a request body (pydantic's error list)."""
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in errors
    )
    return f"invalid request: {problems}"


def error_response(message: str, status: HTTPStatus) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError"}.get(
        status.value, "InternalServerError"
    )
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status.value}},
        status_code=status.value,
    )


async def run_until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()
