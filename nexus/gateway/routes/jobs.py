"""Job routes: submit (checked against the tenant's quotas), list, view, wait, stream, cancel."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query
from fastapi.responses import Response

from nexus.config.validation import validate_job
from nexus.gateway.routes.common import GW, MAX_WAIT_S, PageCursor, PageLimit, Who
from nexus.gateway.state import NDJSON, jsonable
from nexus.spec import JobSpec

router = APIRouter()


@router.post("/v1/tenants/{tenant}/jobs", status_code=201, tags=["jobs"])
async def submit(tenant: str, job: Annotated[JobSpec, Body()], who: Who, gw: GW) -> dict[str, Any]:
    """An SFT, RL or eval job (``kind``); sizes are checked against the tenant's quotas."""
    who.may_act_on(tenant)
    spec, _ = await gw.spec_schema(tenant)
    raw = job.model_dump()
    if spec is not None:
        validate_job(spec, raw, gw.limits(tenant))
    if job.kind in ("sft", "rl"):
        await gw.check_storage(tenant, (await gw.backend.tenant_view(tenant))["output_dir"])
    return {"job": await gw.backend.submit(tenant, raw)}


@router.get("/v1/tenants/{tenant}/jobs", tags=["jobs"])
async def jobs(tenant: str, who: Who, gw: GW, limit: PageLimit = None, cursor: PageCursor = None) -> dict[str, Any]:
    """A page of the tenant's jobs, newest first."""
    who.may_act_on(tenant)
    st = await gw.backend.status(limit, cursor, tenant=tenant)
    return await gw.shown(who, tenant, {"jobs": st["jobs"], "page": st["page"]})


@router.get("/v1/jobs/{job_id}", tags=["jobs"])
async def job(job_id: str, who: Who, gw: GW) -> dict[str, Any]:
    view = await gw.own_job(who, job_id)
    return await gw.shown(who, view["tenant"], view)


@router.get("/v1/jobs/{job_id}/result", tags=["jobs"])
async def result(job_id: str, who: Who, gw: GW, timeout: Annotated[float, Query(ge=0, le=MAX_WAIT_S)] = 30.0
                 ) -> dict[str, Any]:
    """Wait up to ``timeout`` s for the job to end; the job's view either way (check ``state``)."""
    view = await gw.own_job(who, job_id)
    return await gw.shown(who, view["tenant"], await gw.backend.wait(job_id, timeout))


@router.get("/v1/jobs/{job_id}/stream", tags=["jobs"], response_class=NDJSON,
         responses={200: {"content": {"application/x-ndjson": {"schema": {"type": "string"}}}}})
async def stream(job_id: str, who: Who, gw: GW, poll_s: Annotated[float, Query(ge=0.05, le=10)] = 0.5) -> Response:
    """Newline-delimited JSON: the job's view each time its state or progress changes, until it ends."""
    tenant = (await gw.own_job(who, job_id))["tenant"]

    async def lines() -> AsyncIterator[bytes]:
        last = None
        while True:
            info = await gw.shown(who, tenant, await gw.backend.job(job_id))
            key = (info["state"], json.dumps(jsonable(info["progress"]), sort_keys=True))
            if key != last:
                last = key
                yield json.dumps(jsonable(info), allow_nan=False).encode() + b"\n"
            if info["state"] in ("done", "failed", "cancelled"):
                return
            await asyncio.sleep(poll_s)

    return NDJSON(lines())


@router.post("/v1/jobs/{job_id}/cancel", tags=["jobs"])
async def cancel(job_id: str, who: Who, gw: GW) -> Any:
    view = await gw.own_job(who, job_id)
    return await gw.shown(who, view["tenant"], await gw.backend.cancel(job_id))
