"""The predict route (its hot path, :mod:`nexus.gateway.fast_predict`, answers most predicts before it)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from nexus.gateway.contract import OVERLOADED_RESPONSE
from nexus.gateway.routes.common import Who
from nexus.gateway.state import PredictBody
from nexus.gateway.timing import spans_of

router = APIRouter()


@router.post("/v1/tenants/{tenant}/predict", tags=["low level"], responses={429: OVERLOADED_RESPONSE})
async def predict(tenant: str, body: PredictBody, who: Who, request: Request) -> dict[str, Any]:
    """An action from the inference engine, grouped with other tenants' requests. A tenant has at most
    ``limits.max_inflight_predicts`` predicts queued or running at once, the gateway
    ``qos.max_gateway_predicts``: past them the answer is 429 with ``Retry-After`` (nothing was done;
    send again later). Tenants' queued predicts are served round-robin. ``deterministic: false`` samples:
    reproducibly with a ``seed``; ``n`` samples come with their log-probabilities in ``actions`` and
    ``logprobs``. The answer's ``Server-Timing`` header times each hop (http, auth, check, gateway_queue,
    to_engine, engine_queue, forward, reply)."""
    return await request.app.state.gateway.predict(tenant, body, who, spans_of(request.scope) or {})  # type: ignore[return-value]
