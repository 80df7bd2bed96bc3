"""``POST /v1/tenants/{tenant}/predict`` past FastAPI's request machinery, as a pure ASGI middleware.

A predict is the gateway's hottest call and its own work is small (check the token and the observation, queue
it for an engine), so routing over every route, dependency solving, the request object and validating the body
twice (JSON to dicts, then the model) were a third of the gateway's CPU per predict at 64 clients (a py-spy
profile, ``experiments/qos``). Here the path is matched once, the body is validated straight from its bytes, and
the answer goes out as it is. Anything out of the ordinary (another content type, a body the model refuses) is
handed to the FastAPI route unchanged, so its answers — and the OpenAPI document — stay the route's; a request
this path serves gets the same answer the route would give (``tests/test_gateway_fast_predict.py``).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from nexus.gateway.body_limit import replay
from nexus.gateway.timing import spans_of

# tenant, raw body, the Authorization header, the request's spans -> an ASGI response, or None: the route answers
Serve = Callable[[str, bytes, str | None, dict[str, Any]], Awaitable[Any]]

PATH = re.compile(r"/v1/tenants/([^/]+)/predict")  # the route's path (Starlette's {tenant}: no slash)


def json_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """The request says its body is JSON (as ``application/json``, with or without parameters)."""
    for k, v in headers:
        if k == b"content-type":
            return v.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


class PredictFastPath:
    def __init__(self, app, serve: Serve, enabled: bool = True) -> None:
        self.app, self.serve, self.enabled = app, serve, enabled

    async def __call__(self, scope, receive, send) -> None:
        match = (PATH.fullmatch(scope["path"]) if self.enabled and scope["type"] == "http"
                 and scope["method"] == "POST" else None)
        if match is None or not json_body(scope["headers"]):
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:  # bounded: BodyLimit (outside) refused a body over max_request_bytes
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        spans = spans_of(scope)
        response = await self.serve(match.group(1), body, auth, spans if spans is not None else {})
        if response is not None:
            await response(scope, receive, send)
            return
        await self.app(scope, replay(body, receive), send)  # the body read once, handed to the route whole
