"""Where a predict's time goes, as the gateway sees it: a pure ASGI middleware (no per-request task or stream
wrapping, unlike Starlette's ``BaseHTTPMiddleware``) around ``POST /v1/tenants/{tenant}/predict``.

It gives the route a ``spans`` dict (``request.state.spans``) that the route and its dependencies fill with
their hops (:data:`nexus.wire.qos.HOPS`); when the answer starts it adds the ``reply`` hop and the total, writes
them in a ``Server-Timing`` header (durations in ms, the W3C format), and counts a successful predict's total
in its tenant's latency histogram (``observe(tenant, total_s, hops)``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from nexus.wire.qos import HOPS, server_timing

Observe = Callable[[str, float, dict[str, float]], None]


def spans_of(scope: dict[str, Any]) -> dict[str, float] | None:
    """The timed request's spans (None for a request that is not timed)."""
    state = scope.get("state")
    return state.get("nexus_spans") if isinstance(state, dict) else None


class PredictTiming:
    def __init__(self, app, observe: Callable[[], Observe]) -> None:
        self.app, self.observe = app, observe

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith("/predict"):
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        spans: dict[str, Any] = {"_t0": t0}
        scope.setdefault("state", {})["nexus_spans"] = spans

        async def timed_send(message) -> None:
            if message["type"] == "http.response.start":
                now = time.perf_counter()
                if "_t_done" in spans:
                    spans["reply"] = now - spans["_t_done"]
                hops = {k: spans[k] for k in HOPS if k in spans}
                header = server_timing({**hops, "total": now - t0}).encode()
                message = {**message, "headers": [*message.get("headers", []), (b"server-timing", header)]}
                tenant = spans.get("_tenant")
                if tenant is not None and message["status"] == 200:
                    self.observe()(tenant, now - t0, hops)
            await send(message)

        await self.app(scope, receive, timed_send)
