"""The service's status view (``nexus status``, ``/nexus/api/state``, the ``/nexus`` page, ``/metrics``).

Plain reads of the control plane's parts (:class:`StatusParts`, wired by the Master); never blocks.
``roles`` lists every role with its health state (``healthy`` / ``suspect`` / ``failed`` / ``restarting``
/ ``starting``), worker, restarts and heartbeat age; a tenant whose training waits on a role that is
down says so in ``waiting_for``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nexus.control.jobs.state import JobStatus
from nexus.control.tenants.registry import TenantPhase
from nexus.wire.paging import Page

if TYPE_CHECKING:
    from nexus.control.dispatch.dispatcher import Dispatcher
    from nexus.control.dispatch.scheduler import SchedulerControl
    from nexus.control.dispatch.training_queue import TrainingQueue
    from nexus.control.health.actor_group import ActorGroup
    from nexus.control.health.engine_pool import EnginePool
    from nexus.control.health.manager import HealthManager
    from nexus.control.health.supervisor import Supervisor
    from nexus.control.jobs.manager import JobManager
    from nexus.control.monitoring.accounting import ServiceAccounting
    from nexus.control.monitoring.state import MonitoringState
    from nexus.control.tenants.offload import SlotOffload
    from nexus.control.tenants.registry import TenantRegistry


RECENT_JOBS = 5  # job ids per tenant row: a row's size never grows with the jobs a tenant ever ran


@dataclass(frozen=True)
class StatusParts:
    """What the status view reads."""

    scheduler: Any  # the Dask scheduler (its workers)
    registry: TenantRegistry
    jobs: JobManager
    queue: TrainingQueue
    dispatcher: Dispatcher
    actors: ActorGroup
    pool: EnginePool
    health: HealthManager
    supervisor: Supervisor
    monitoring: MonitoringState
    accounting: ServiceAccounting
    schedulers: SchedulerControl  # the scheduling view and the effective config
    offload: SlotOffload | None = None  # which tenants' actor slots are on disk


def tenant_rows(p: StatusParts, names: list[str] | None = None) -> list[dict[str, Any]]:
    """Status rows of the tenants ``names`` (default: every tenant)."""
    serving = bool(p.pool.serving())
    rows = []
    tenants = list(p.registry) if names is None else [t for n in names if (t := p.registry.find(n)) is not None]
    for t in tenants:
        c = p.queue.counters.get(t.name)
        running_eval = any(p.jobs.jobs[j].state == JobStatus.RUNNING for j in t.jobs if j in p.jobs.jobs)
        state = {TenantPhase.CREATING: "restoring" if t.restored else "creating",
                 TenantPhase.DELETING: "deleting"}.get(t.phase) or (
            "training" if t.training_job else "evaluating" if running_eval else "idle")
        waiting = []
        if t.training_job and not p.actors.ready:
            waiting.append("actor")
        if (t.training_job or running_eval) and not serving:
            waiting.append("inference")
        rows.append({**t.view(), "jobs": list(t.jobs)[-RECENT_JOBS:], "jobs_total": len(t.jobs),
                     "state": state, "waiting_for": waiting,
                     "inflight": c.inflight if c else 0, "queued": c.queued if c else 0,
                     "running": c.running if c else 0, "dropped_stale": c.dropped_stale if c else 0,
                     "max_inflight_seen": c.max_inflight_seen if c else 0,
                     "metered_s": p.monitoring.tenant_metering(t.name),
                     "offloaded": p.offload is not None and t.name in p.offload.offloaded})
    return rows


def service_view(p: StatusParts) -> dict[str, Any]:
    h = p.health
    spent = h.needs_global_restart()
    down = [r.role for r in h.roles.values() if r.state in ("failed", "restarting", "suspect")]
    state = "needs-global-restart" if spent else "degraded" if down else "ok"
    return {"state": state, "boot_time": p.supervisor.boot_time, "roles_down": sorted(down),
            "needs_global_restart": spent, "discovery": dict(p.supervisor.discovery),
            "restarts": sum(r.restarts for r in h.roles.values()),
            "retried_items": {"role_lost": p.dispatcher.retried_lost, "errors": p.dispatcher.retried_errors},
            "transitions": list(h.history)[-200:],  # recent role state changes, oldest first
            "health_policy": h.settings.model_dump()}


def control_signals(p: StatusParts) -> dict[str, Any]:
    """One sample of the control signals: queue depths, in-flight and version lag of the tenants with work
    (an idle tenant adds nothing: a sample's size follows the work, not the tenants ever seen)."""
    versions = p.registry.versions()
    return {"training_depth": len(p.queue), "inference_pending": p.monitoring.inference_pending,
            "by_tenant": {n: {"queued": c.queued, "inflight": c.inflight, "version": versions.get(n, 0)}
                          for n, c in p.queue.counters.items() if c.queued or c.inflight},
            "lag": p.queue.lags(versions)}


def tenant_log(p: StatusParts, tenant: str) -> dict[str, Any]:
    """A tenant's jobs with their full metric histories (CLI ``logs`` and ``report``)."""
    t = p.registry.get(tenant)
    return {"tenant": t.view(), "t_start": p.monitoring.t_start,
            "jobs": [{**p.jobs.view(p.jobs.jobs[j]), "history": p.jobs.jobs[j].history}
                     for j in t.jobs if j in p.jobs.jobs],
            "spans": [vars(sp) for sp in p.monitoring.spans]}


def build(p: StatusParts, page: Page | None = None) -> dict[str, Any]:
    """The status, one page of tenants and jobs (``page``: default the first :data:`DEFAULT_LIMIT` of each)."""
    page = page or Page()
    now = time.time()
    versions = p.registry.versions()
    names, more_tenants = page.tenants(p.registry.names())
    jobs, more_jobs = page.jobs(p.jobs.jobs.values())
    workers = [{"name": str(ws.name), "address": ws.address, "status": ws.status.name,
                "resources": dict(ws.resources), "since_heartbeat_s": round(now - ws.last_seen, 3),
                "processing": len(ws.processing)} for ws in p.scheduler.workers.values()]
    return {"tenants": tenant_rows(p, names), "jobs": [p.jobs.view(j) for j in jobs],
            "page": page.info(names, more_tenants, jobs, more_jobs,
                              {"tenants_total": len(p.registry), "jobs_total": len(p.jobs.jobs)}),
            "training_queue": {"depth": len(p.queue), "by_tenant": p.queue.depth(), "lag": p.queue.lags(versions),
                               "delay_s": p.queue.delay_view()},
            "inference_queue": {"pending": p.monitoring.inference_pending},
            # the SIM slots' fair share: capacity, slots held and requests waiting per tenant
            "simulators": p.jobs.ctx.sim_slots.view() if p.jobs.ctx.sim_slots is not None else None,
            "roles": p.health.views(now), "service": service_view(p), "inference": p.pool.view(names),
            "actor": {"ranks": p.actors.world_size, "ready": p.actors.ready, "workers": list(p.actors.workers),
                      "epoch": p.actors.epoch, "running": [i.item_id for i in p.dispatcher.running],
                      "last_rebuild_reason": p.actors.broken_reason},
            "workers": workers, "busy_s": dict(p.monitoring.busy), "actor_busy": len(p.dispatcher.running),
            "scheduling": p.schedulers.view(),
            "decisions": {**p.queue.times.view(), **p.pool.routing.times.view()},  # plugin decision latency, us
            "accounting": p.accounting.totals(),  # windows: the nexus_accounting handler
            "config": p.schedulers.config.model_dump()}
