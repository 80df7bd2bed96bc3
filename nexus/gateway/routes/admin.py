"""Operator routes: monitoring, flush, scale, readiness, the QoS view, all tenants."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import Field

from nexus.gateway.routes.common import GW, PageCursor, PageLimit, Who
from nexus.gateway.state import StrictBody


class ScaleBody(StrictBody):
    engines: int = Field(ge=1, le=64, description="inference engines to run")


router = APIRouter()


@router.get("/v1/admin/monitoring", tags=["admin"])
async def monitoring(who: Who, gw: GW, since: Annotated[float, Query(ge=0, le=1e12)] = 0.0, limit: PageLimit = None,
                     cursor: PageCursor = None) -> dict[str, Any]:
    """The status page (as ``/v1/status``) with its tenants' signals since ``since``."""
    who.require_operator("monitoring")
    return await gw.backend.monitoring(since, limit, cursor)


@router.post("/v1/admin/flush", tags=["admin"])
async def flush(who: Who, gw: GW) -> dict[str, Any]:
    who.require_operator("flush")
    return {"flushed": await gw.backend.flush()}


@router.post("/v1/admin/scale", tags=["admin"])
async def scale(body: ScaleBody, who: Who, gw: GW) -> Any:
    who.require_operator("scaling the inference service")
    return await gw.backend.scale_inference(body.engines)


@router.get("/v1/admin/ready", tags=["admin"])
async def ready(who: Who, gw: GW, timeout: float = Query(60.0, ge=0, le=600)) -> Any:
    """Wait until the actor group and an inference engine serve."""
    who.require_operator("waiting for the service")
    return await gw.backend.wait_ready(timeout)


@router.get("/v1/admin/qos", tags=["admin"])
async def qos(who: Who, gw: GW) -> dict[str, Any]:
    """The predict path now: budgets held per tenant, requests queued per engine, mean time per hop, predicts
    the fast path answered, the openpi endpoint's connections and frames answered."""
    who.require_operator("the QoS view")
    return {**gw.serving.view(), "fast_path_served": gw.fast_path_served,
            "openpi": gw.openpi.view() if gw.openpi is not None else None}


@router.get("/v1/admin/tenants", tags=["admin"])
async def all_tenants(who: Who, gw: GW, limit: PageLimit = None, cursor: PageCursor = None) -> dict[str, Any]:
    """A page of the tenants (``page.next_cursor`` continues) and the names holding a token."""
    who.require_operator("listing all tenants")
    st = await gw.backend.status(limit, cursor)
    return {"tenants": st["tenants"], "page": st["page"], "with_token": gw.tokens.tenants(), "time": time.time()}
