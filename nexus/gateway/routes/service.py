"""Service routes: liveness and the status page (the operator's whole service, a tenant's own view)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from nexus.gateway.routes.common import GW, PageCursor, PageLimit, Who

router = APIRouter()


@router.get("/health", tags=["service"])
async def health() -> dict[str, Any]:
    return {"ok": True}


@router.get("/v1/status", tags=["service"])
async def status(who: Who, gw: GW, limit: PageLimit = None, cursor: PageCursor = None,
                 tenant: Annotated[str | None, Query(max_length=64)] = None) -> dict[str, Any]:
    """Operator: the whole service, a page at a time (``limit`` tenants and ``limit`` jobs, newest jobs
    first; ``page.next_cursor`` continues), or one ``tenant``'s. Tenant: its own tenant and a page of its
    jobs only."""
    if who.operator:
        return await gw.backend.status(limit, cursor, tenant)
    if tenant is not None and tenant != who.tenant:  # another tenant is unknown to this token, as its jobs are
        return {"tenants": [], "jobs": [], "page": {"limit": limit, "next_cursor": None}}
    st = await gw.backend.status(limit, cursor, tenant=who.tenant)
    return await gw.shown(who, who.tenant, {"tenants": st["tenants"], "jobs": st["jobs"], "page": st["page"]})
