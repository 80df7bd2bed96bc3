"""``limits.max_request_bytes`` for every request body, as a pure ASGI middleware (no per-request task or
stream wrapping: Starlette's ``BaseHTTPMiddleware`` cost every call of the gateway a task and two memory
streams). A declared ``Content-Length`` over the limit is refused before the body is read; a chunked body
is read up to the limit, then handed on whole."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from nexus.errors import LimitExceeded

Refusal = Callable[[LimitExceeded], Any]  # -> an ASGI response (413)


class BodyLimit:
    def __init__(self, app, limit: int, refuse: Refusal) -> None:
        self.app, self.limit, self.refuse = app, limit, refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None:
            if not length.isdigit() or int(length) > self.limit:
                e = LimitExceeded(f"request body: {length.decode(errors='replace')} bytes is over the limit "
                                  f"max_request_bytes={self.limit}")
                await self.refuse(e)(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                e = LimitExceeded(f"request body: over the limit max_request_bytes={self.limit}")
                await self.refuse(e)(scope, receive, send)
                return
        await self.app(scope, replay(bytes(body), receive), send)


def replay(body: bytes, receive: Callable[[], Awaitable[dict[str, Any]]]) -> Callable[[], Awaitable[dict[str, Any]]]:
    """An ASGI ``receive`` that hands on a body already read, whole, then the connection's own messages."""
    replayed = False

    async def receive_again() -> dict[str, Any]:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again
