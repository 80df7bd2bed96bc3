"""Tenant lifecycle: create (from a validated spec: build the slot from durable state, register on every engine,
route) and delete (cancel its jobs, drop its queue entries, routes, engine heads and slot, and keep
or purge its output dir)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from nexus.config.paths import resolve_output_dir
from nexus.config.validation import check_new_tenant, schema_of, validate_tenant
from nexus.control import tasks
from nexus.control.dispatch.training_queue import TenantLimits
from nexus.control.tenants.registry import TenantPhase, TenantState
from nexus.errors import Conflict, NotFound
from nexus.wire.messages import SlotInfo

if TYPE_CHECKING:
    from nexus.config.service import ServiceConfig, ServiceLimits
    from nexus.control.dispatch.dispatcher import Dispatcher
    from nexus.control.health.actor_group import ActorGroup
    from nexus.control.health.engine_pool import EnginePool
    from nexus.control.jobs.manager import JobManager
    from nexus.control.tenants.registry import TenantRegistry
    from nexus.spec import TenantSpec

logger = logging.getLogger("nexus.lifecycle")

CREATE_TIMEOUT_S = 900.0  # includes waiting for a restarting actor


def with_admission_defaults(spec: TenantSpec, limits: ServiceLimits) -> TenantSpec:
    """The spec with the tenant's admission defaults (``limits.default_max_inflight``, at most
    ``limits.max_inflight``, and ``limits.default_max_staleness``) where the tenant left them unset (the stored
    spec then holds the values it runs with, so a restored tenant keeps them)."""
    inflight = min(limits.default_max_inflight, limits.max_inflight)
    update = {k: v for k, v in (("max_inflight", inflight),
                                ("max_staleness", limits.default_max_staleness)) if getattr(spec, k) is None}
    return spec.model_copy(update=update) if update else spec


class TenantLifecycle:
    def __init__(self, config: ServiceConfig, registry: TenantRegistry, actors: ActorGroup, pool: EnginePool,
                 dispatcher: Dispatcher, jobs: JobManager, event) -> None:
        self.config = config
        self.registry = registry
        self.actors = actors
        self.pool = pool
        self.dispatcher = dispatcher
        self.jobs = jobs
        self._event = event

    def apply(self, config: ServiceConfig) -> None:
        """A new scheduler: tenants created from now on get its admission defaults."""
        self.config = config

    def read_back(self, raw: dict[str, Any]) -> TenantSpec:
        """A spec read back from a tenant's files at rediscovery, validated as the gateway validates a new one
        (the catalogs, the tenant's quotas): no gateway saw it in this service's life."""
        spec, _ = validate_tenant(raw, self.config.limits_for(str(raw.get("name"))))
        return spec

    async def create(self, spec: TenantSpec) -> dict[str, Any]:
        """Build a validated spec's slot (validated once, where it entered: the gateway for a new tenant,
        :meth:`read_back` for one read back from its files); a tenant whose output dir holds state resumes it."""
        schema = schema_of(spec)
        limits = self.config.limits_for(spec.name)
        spec = with_admission_defaults(spec, limits)  # capped at the quota
        existing = self.registry.find(spec.name)
        if existing is not None:
            if existing.phase == "deleting":
                raise Conflict(f"tenant {spec.name!r} is being deleted")
            if existing.spec != spec:
                raise Conflict(f"tenant {spec.name!r} exists with another spec")
            await asyncio.wait_for(existing.ready.wait(), CREATE_TIMEOUT_S)
            return existing.view()
        check_new_tenant(len(self.registry), limits)
        output_dir = resolve_output_dir(spec.name, spec.output_dir, self.config.tenants_dir, self.config.output_base,
                                        [(o.name, o.output_dir) for o in self.registry])
        t = self.registry.add(TenantState(spec=spec, schema=schema, output_dir=output_dir))
        queue = self.dispatcher.queue
        assert spec.max_inflight is not None and spec.max_staleness is not None  # with_admission_defaults
        queue.set_limits(spec.name, TenantLimits(spec.max_inflight, spec.max_staleness, spec.priority))
        try:
            info: SlotInfo = await self.actors.run(tasks.INIT_TENANT, lambda r: (t.setup(),),
                                                   key=f"nexus-init-{spec.name}", retry_lost=True,
                                                   timeout=CREATE_TIMEOUT_S)
            t.version, t.restored = info.version, info.restored
            self.jobs.ids.observe(info.job_seq)
            t.move(TenantPhase.READY)  # from now on a rebuilt actor or a joining engine includes it
            await self.pool.add_tenant(t.setup())
        except BaseException:
            self.registry.remove(spec.name)
            queue.remove_tenant(spec.name)
            t.ready.set()
            raise
        t.ready.set()
        self._event("tenant", {"tenant": spec.name, "version": t.version, "restored": info.restored})
        return t.view()

    async def delete(self, name: str, keep_output: bool = True) -> dict[str, Any]:
        """Remove a tenant from the service; its output dir stays unless ``keep_output`` is False."""
        t = self.registry.get(name)
        if t.phase != "ready":
            raise Conflict(f"tenant {name!r} is {t.phase}")
        t.move(TenantPhase.DELETING)
        cancelled = []
        for js in self.jobs.of_tenant(name):
            if js.state not in ("done", "failed", "cancelled"):
                await self.jobs.cancel(js.job_id, recorded=True)
                cancelled.append(js.job_id)
        self.dispatcher.drop_tenant(name, NotFound(f"tenant {name!r} was deleted"))
        await self.pool.remove_tenant(name)
        try:
            await self.actors.run(tasks.DROP_TENANT, lambda r: (name,), key=f"nexus-drop-{name}", retry_lost=True,
                                  timeout=300)
        except Exception as e:  # a rebuilt actor has no slot for it anyway: it left the registry
            logger.warning("dropping the slot of %s: %s", name, e)
        self.registry.remove(name)
        purged = False
        if not keep_output:
            await self.actors.run(tasks.PURGE_OUTPUT, lambda r: (t.output_dir, name, str(self.config.root)),
                                  key=f"nexus-purge-{name}", retry_lost=True, timeout=300, first_only=True)
            purged = True
        self._event("tenant", {"tenant": name, "deleted": True, "purged": purged})
        return {"tenant": name, "output_dir": t.output_dir, "purged": purged, "cancelled_jobs": cancelled}
