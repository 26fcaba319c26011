"""Request bodies beyond a size are refused with HTTP 413, before they are read into memory.

A declared ``Content-Length`` over the limit is refused at once; a body sent without one
(chunked) is counted as it streams and refused as soon as it passes the limit.
"""

from __future__ import annotations

import json

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20


class BodyLimit:
    """Pure ASGI middleware: 413 for HTTP request bodies over ``max_bytes``."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._refuse(send)
                return
        received = 0
        started = False
        refused = False

        async def counted_receive():
            # past the limit: answer 413 now, and tell the app the client is gone (frameworks turn
            # an exception raised from here into a 400 of their own)
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    if not started and not refused:
                        refused = True
                        await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message):
            nonlocal started
            if refused:
                return  # the 413 is the answer
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, counted_receive, tracked_send)

    async def _refuse(self, send) -> None:
        message = f"request body too large: the limit is {self.max_bytes} bytes (--max-request-body-mb)"
        body = json.dumps(
            {"error": {"message": message, "type": "RequestTooLarge", "param": None, "code": 413}}
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
