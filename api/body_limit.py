"""ASGI middleware refusing request bodies over a byte limit with a 413, before any parsing."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_BODY_BYTES = 8 * 2**20
"""The default limit: request bodies above this many bytes are refused with a 413."""


class BodyLimit:
    """Reads each HTTP request body (at most `max_bytes`) before the app does; a larger body
    (by its `Content-Length` or as it arrives) gets `reject(413, message, None, code)`, a
    Starlette response."""

    def __init__(self, app: ASGIApp, max_bytes: int, reject: Callable):
        self.app, self.max_bytes, self.reject = app, max_bytes, reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = self.reject(
            413, f"request body over {self.max_bytes} bytes", None, "request_too_large"
        )
        await response(scope, receive, send)
