"""Tenant routes: create (validated here, where a spec enters the service), view, delete, logs, export."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from fastapi import APIRouter
from pydantic import Field

from nexus.config.paths import confine
from nexus.config.validation import validate_tenant
from nexus.errors import Conflict, Forbidden, NotFound, SpecError, quote
from nexus.gateway.contract import relative_paths
from nexus.gateway.routes.common import GW, MaybeWho, Who
from nexus.gateway.state import StrictBody
from nexus.spec import TenantSpec


class ExportBody(StrictBody):
    version: int | None = Field(None, ge=0, le=2**31 - 1, description="policy version; default: the current one")
    path: str | None = Field(None, max_length=4096,
                             description="default: the tenant's exports/vNNNNNN/ (read it with GET .../files). "
                                         "Relative paths are inside the tenant's output dir; tenant tokens may "
                                         "name no path outside it, the operator token may")


router = APIRouter()


@router.post("/v1/tenants", status_code=201, tags=["tenants"])
async def create_tenant(spec: TenantSpec, who: MaybeWho, gw: GW) -> dict[str, Any]:
    """Validate a spec and allocate the tenant's slot; the answer carries its secret ``token`` (shown
    once). Re-creating an existing tenant needs its token (or the operator's) and returns no new one."""
    if not gw.registration_open and not (who and who.operator):
        why = ("open_registration = false" if gw.config.open_registration is False else
               f"the gateway listens on {gw.bind}, not loopback, and open_registration is not set to true")
        raise Forbidden(f"creating tenants needs the operator token on this service ({why})")
    name = spec.name
    validate_tenant(spec, gw.limits(name))
    if spec.init_from is not None and not (who and who.operator):  # a server path: never another's export
        own = (await gw.backend.tenant_view(who.tenant))["output_dir"] if who and who.tenant else None
        await asyncio.to_thread(init_from_allowed, spec.init_from, own)
    raw = spec.model_dump()
    async with gw.create_lock:
        if name in gw.tokens:
            if who is None or not (who.operator or who.tenant == name):
                raise Conflict(f"tenant {name!r} exists; re-creating it needs its token")
            return await gw.shown(who, name, {**await gw.backend.create_tenant(raw), "token": None})
        if (await gw.backend.status(tenant=name))["tenants"]:
            raise Conflict(f"tenant {name!r} exists (created inside the service)")
        view = await gw.backend.create_tenant(raw)
        gw.forget(name)  # a re-created name may have another output dir
        return await gw.shown(who, name, {**view, "token": gw.tokens.issue(name, raw)})


@router.get("/v1/tenants/{tenant}", tags=["tenants"])
async def tenant_view(tenant: str, who: Who, gw: GW) -> dict[str, Any]:
    who.may_act_on(tenant)
    return await gw.shown(who, tenant, await gw.backend.tenant_view(tenant))


@router.delete("/v1/tenants/{tenant}", tags=["tenants"])
async def delete_tenant(tenant: str, who: Who, gw: GW, purge: bool = False) -> dict[str, Any]:
    """Cancel the tenant's jobs, release its slot and forget it; its output dir stays unless ``purge``.
    Its token stops working."""
    who.may_act_on(tenant)
    own = await gw.output_dir(tenant)
    res = await gw.backend.delete_tenant(tenant, keep_output=not purge)
    gw.tokens.revoke(tenant)
    gw.forget(tenant)
    out = {**(res if isinstance(res, dict) else {}), "tenant": tenant, "deleted": True}
    return out if who.operator else relative_paths(out, own, str(gw.config.root))


@router.get("/v1/tenants/{tenant}/logs", tags=["tenants"])
async def logs(tenant: str, who: Who, gw: GW) -> dict[str, Any]:
    """Every job of the tenant with its metric history; utilization spans of this tenant only."""
    who.may_act_on(tenant)
    log = await gw.backend.tenant_log(tenant)
    # a grouped inference span names every tenant of the group: keep only this tenant's name
    log["spans"] = [{**sp, "tenant": tenant} for sp in log.get("spans", [])
                    if tenant in str(sp.get("tenant", "")).split("+")]
    return await gw.shown(who, tenant, log)


@router.post("/v1/tenants/{tenant}/export", tags=["tenants"])
async def export(tenant: str, who: Who, gw: GW, body: ExportBody | None = None) -> Any:
    """Write a policy version as a self-contained directory (``nexus.export.policy.load`` runs it without a
    service): by default the tenant's own ``exports/vNNNNNN/``, whose files ``GET .../files/exports/...``
    downloads. The answer names it (``path``; ``relative_path`` inside the output dir)."""
    who.may_act_on(tenant)
    body = body or ExportBody()
    output_dir = (await gw.backend.tenant_view(tenant))["output_dir"]
    options: dict[str, Any] = {"version": body.version}
    if body.path is not None:
        options["path"] = await asyncio.to_thread(export_target, body.path, output_dir, who.operator)
    if not who.operator:
        await gw.check_storage(tenant, output_dir)
    return await gw.shown(who, tenant, await gw.backend.export(tenant, **options))


# folders of an output dir the service writes and prunes itself (nexus.data.output_dir): no export goes there
_MANAGED = frozenset({"weights", "checkpoints", "trajectories", "eval", "jobs"})


def export_target(path: str, output_dir: str, operator: bool) -> str:
    """The absolute export path a caller may name. Relative paths are inside the tenant's output dir; a
    tenant's path must stay inside it (no '..', no symlink on the way, not the dir itself or a folder the
    service manages); the operator may name any absolute path."""
    if "\x00" in path or not path.strip():
        raise SpecError(f"export path {quote(path)} is not a path")
    full = path if os.path.isabs(path) else os.path.join(output_dir, path)
    if operator:
        return os.path.normpath(full)
    if ".." in path.split("/"):
        raise Forbidden(f"export path {quote(path)}: '..' is not allowed")
    try:
        target = confine(full, output_dir)
        rel = target.relative_to(confine(output_dir, output_dir))
    except (Forbidden, ValueError):
        raise Forbidden(f"export path {quote(path)} refused: a tenant exports only inside its own output dir "
                        "(default: exports/vNNNNNN)") from None
    if not rel.parts or rel.parts[0] in _MANAGED or rel.parts[0] == "manifest.json":
        raise Forbidden(f"export path {quote(path)} refused: it is the output dir or a folder the service manages; "
                        "use a path under exports/")
    return str(target)


def init_from_allowed(path: str, own_dir: str | None) -> None:
    """A tenant token may start a new tenant only from an export inside its own output dir."""
    if own_dir is None:
        raise Forbidden("init_from needs the operator token, or a tenant token whose output dir holds the export")
    if not os.path.isabs(path) or ".." in path.split("/"):
        raise Forbidden(f"init_from {quote(path)} refused: give the absolute path of an export in your output dir")
    try:
        confine(path, own_dir, must_exist=True)
    except (Forbidden, NotFound):
        raise Forbidden(f"init_from {quote(path)} refused: a tenant may start from an export inside its own output "
                        "dir only") from None
