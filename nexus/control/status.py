"""The service's status view (``nexus status``, ``/nexus/api/state``, the ``/nexus`` page, ``/metrics``).

Plain reads of the control plane's parts; never blocks. ``roles`` lists every role with its health
state (``healthy`` / ``suspect`` / ``failed`` / ``restarting`` / ``starting``), worker, restarts and
heartbeat age; a tenant whose training waits on a role that is down says so in ``waiting_for``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from nexus.control.monitoring import SERVICES

if TYPE_CHECKING:
    from nexus.control.master import Master


def tenant_rows(m: Master) -> list[dict[str, Any]]:
    metering = m.monitoring.metering_table()
    serving = bool(m.pool.serving())
    rows = []
    for t in m.registry:
        c = m.queue.counters.get(t.name)
        running_eval = any(m.jobs.jobs[j].state == "running" for j in t.jobs if j in m.jobs.jobs)
        state = {"creating": "restoring" if t.restored else "creating", "deleting": "deleting"}.get(t.phase) or (
            "training" if t.training_job else "evaluating" if running_eval else "idle")
        waiting = []
        if t.training_job and not m.actors.ready:
            waiting.append("actor")
        if (t.training_job or running_eval) and not serving:
            waiting.append("inference")
        rows.append({**t.view(), "state": state, "waiting_for": waiting,
                     "inflight": c.inflight if c else 0, "queued": c.queued if c else 0,
                     "running": c.running if c else 0, "dropped_stale": c.dropped_stale if c else 0,
                     "max_inflight_seen": c.max_inflight_seen if c else 0,
                     "metered_s": metering.get(t.name, {s: 0.0 for s in SERVICES})})
    return rows


def service_view(m: Master) -> dict[str, Any]:
    h = m.health
    spent = h.needs_global_restart()
    down = [r.role for r in h.roles.values() if r.state in ("failed", "restarting", "suspect")]
    state = "needs-global-restart" if spent else "degraded" if down else "ok"
    return {"state": state, "boot_time": m.supervisor.boot_time, "roles_down": sorted(down),
            "needs_global_restart": spent, "discovery": dict(m.supervisor.discovery),
            "restarts": sum(r.restarts for r in h.roles.values()),
            "retried_items": {"role_lost": m.dispatcher.retried_lost, "errors": m.dispatcher.retried_errors},
            "transitions": list(h.history)[-200:],  # recent role state changes, oldest first
            "health_policy": vars(h.policy)}


def build(m: Master) -> dict[str, Any]:
    now = time.time()
    versions = m.registry.versions()
    workers = [{"name": str(ws.name), "address": ws.address, "status": ws.status.name,
                "resources": dict(ws.resources), "since_heartbeat_s": round(now - ws.last_seen, 3),
                "processing": len(ws.processing)} for ws in m.scheduler.workers.values()]
    return {"tenants": tenant_rows(m), "jobs": [m.jobs.view(j) for j in m.jobs.jobs.values()],
            "training_queue": {"depth": len(m.queue), "by_tenant": m.queue.depth(), "lag": m.queue.lags(versions)},
            "inference_queue": {"pending": m.monitoring.inference_pending},
            "roles": m.health.views(now), "service": service_view(m), "inference": m.pool.view(),
            "actor": {"ranks": m.actors.world_size, "ready": m.actors.ready, "workers": list(m.actors.workers),
                      "epoch": m.actors.epoch, "running": [i.item_id for i in m.dispatcher.running]},
            "workers": workers, "busy_s": dict(m.monitoring.busy), "actor_busy": len(m.dispatcher.running),
            "scheduling": m.scheduling(),
            "accounting": m.monitoring.totals(m.slots(), m.worker_aliases()),  # windows: the nexus_accounting handler
            "config": m.config.model_dump()}
