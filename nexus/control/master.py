"""The Master Service: builds the control plane's parts, wires them, and answers the RPC handlers.

===================  ==============================================================================
part                 module
===================  ==============================================================================
tenant registry      :mod:`nexus.control.tenants.registry` (+ lifecycle: :mod:`nexus.control.tenants.lifecycle`)
jobs and flows       :mod:`nexus.control.jobs.manager` (records: :mod:`nexus.control.jobs.state`),
                     :mod:`nexus.control.jobs.flows`
training queue       :mod:`nexus.control.dispatch.training_queue` + dispatcher :mod:`nexus.control.dispatch.dispatcher`
actor group          :mod:`nexus.control.health.actor_group` (N ranks)
inference pool       :mod:`nexus.control.health.engine_pool` (M engines: :mod:`~nexus.control.health.membership`,
                     :mod:`~nexus.control.dispatch.routing`; on the cluster: :mod:`~nexus.control.health.engine_ops`)
health + restarts    :mod:`nexus.control.health.manager`, :mod:`nexus.control.health.supervisor` (rediscovery at boot:
                     :mod:`nexus.control.tenants.discovery`)
tracking             :mod:`nexus.control.monitoring.tracking_link` (the tracker itself runs on a worker)
low-level ops        :mod:`nexus.control.jobs.low_level` (their MLflow runs: :mod:`nexus.control.jobs.op_runs`)
scheduler            :mod:`nexus.control.dispatch.scheduler` (view, switch), accounting
                     :mod:`nexus.control.monitoring.accounting`, status view :mod:`nexus.control.monitoring.status`
Dask                 :mod:`nexus.control.runtime`, tasks by import path :mod:`nexus.control.tasks`
===================  ==============================================================================

Everything runs on the scheduler's event loop; nothing blocks it and nothing imports torch.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nexus.config.service import ServiceConfig
from nexus.control.dispatch.adaptive import LoadRouting
from nexus.control.dispatch.dispatcher import Dispatcher
from nexus.control.dispatch.scheduler import SchedulerControl
from nexus.control.dispatch.training_queue import TrainingItem, TrainingQueue
from nexus.control.health.actor_group import ActorGroup
from nexus.control.health.engine_ops import DaskEngineOps
from nexus.control.health.engine_pool import EnginePool
from nexus.control.health.manager import HealthManager
from nexus.control.health.supervisor import Supervisor
from nexus.control.jobs import flows
from nexus.control.jobs.exports import export_version
from nexus.control.jobs.low_level import LowLevelOps
from nexus.control.jobs.manager import JobManager
from nexus.control.jobs.op_runs import OpRuns
from nexus.control.monitoring import status
from nexus.control.monitoring.accounting import ServiceAccounting
from nexus.control.monitoring.state import MonitoringState
from nexus.control.monitoring.tracking_link import TrackerLink
from nexus.control.runtime import DaskRuntime
from nexus.control.tenants.lifecycle import TenantLifecycle
from nexus.control.tenants.offload import SlotOffload
from nexus.control.tenants.registry import TenantPhase, TenantRegistry
from nexus.errors import NotFound, Unavailable
from nexus.spec import TenantSpec
from nexus.wire.messages import OpWork, UpdateResult
from nexus.wire.paging import Page

logger = logging.getLogger("nexus.master")


class Master:
    def __init__(self, config: ServiceConfig, scheduler) -> None:
        self.scheduler = scheduler
        self.runtime = DaskRuntime(scheduler, config)
        self.monitoring = MonitoringState()
        self.health = HealthManager(config.health)
        self.registry = TenantRegistry()
        self.queue = TrainingQueue(config.dispatch.queue_order)
        self.actors = ActorGroup(self.runtime, config.actor_ranks)
        self.engine_ops = DaskEngineOps(self.runtime, config)
        self.pool = EnginePool(self.engine_ops, lambda: [t.setup() for t in self.registry.ready()],
                               config.inference_engines, health=self.health,
                               batching=(config.infer_max_wait_s, config.infer_max_batch))
        self.dispatcher = Dispatcher(self.queue, self._execute, self.registry.version_view, config.dispatch,
                                     lambda: self.actors.ready and not self.offload.busy)
        self.tracker = TrackerLink(self._send_tracker, on_error=lambda e: self.health.error("tracker", e))
        self.op_runs = OpRuns(self.tracker, config.ops_idle_s)
        ctx = flows.FlowContext(self.dispatcher, self.queue, self.pool, self.health, self.runtime,
                                config.dispatch.rollout_attempts, log=lambda *a: None, datapath=config.datapath,
                                simulators=config.simulators)
        ctx.follow(config.dispatch)
        self.jobs = JobManager(self.registry, ctx, self.actors, self.runtime, self.tracker, self.monitoring,
                               self._event, self._flush_engine_signals, config.limits_for,
                               isolated=config.dispatch.isolated)
        self.lifecycle = TenantLifecycle(config, self.registry, self.actors, self.pool, self.dispatcher, self.jobs,
                                         self._event)
        self.offload = SlotOffload(config.offload_idle_s, self.registry, self.jobs, self.queue, self.dispatcher,
                                   self.actors)
        self.supervisor = Supervisor(config, self.runtime, self.health, self.actors, self.pool, self.registry,
                                     self.tracker, self.dispatcher, self.lifecycle, self.jobs, self.offload)
        self.ops = LowLevelOps(self.registry, self.runtime, ctx, self.op_runs)
        self.accounts = ServiceAccounting(scheduler, self.actors, self.pool, self.monitoring)
        self.routing = LoadRouting(self.pool, self.monitoring, self.jobs, self.dispatcher, config.routing)
        parts = [self.queue, self.dispatcher, self.jobs, self.lifecycle, self.engine_ops, self.supervisor, self.routing]
        self.schedulers = SchedulerControl(config, parts, self.pool, self.jobs, self.queue, self.dispatcher)
        self.parts = status.StatusParts(scheduler, self.registry, self.jobs, self.queue, self.dispatcher, self.actors,
                                        self.pool, self.health, self.supervisor, self.monitoring, self.accounts,
                                        self.schedulers, self.offload)
        self._sampler: asyncio.Task | None = None

    @property
    def config(self) -> ServiceConfig:  # the effective one (a scheduler switch replaces it)
        return self.schedulers.config

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        self.tracker.start()
        self.supervisor.start()
        self._sampler = asyncio.get_running_loop().create_task(self._sample_forever())

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
        ended = self.op_runs.close_all()
        if (ended or self.tracker.pending) and self.tracker.address is not None:  # what was sent still lands
            await self.tracker.flush(timeout=3.0)
        await self.supervisor.close()
        await self.tracker.close()
        await self.dispatcher.close()
        for js in self.jobs.jobs.values():
            if js.task is not None:
                js.task.cancel()
        await self.runtime.close()

    # -- wiring ----------------------------------------------------------------------------------------------
    async def _execute(self, item: TrainingItem) -> dict[str, Any]:
        """Run one training item on the actor group (the dispatcher's work)."""
        t = self.registry.get(item.tenant)
        self.offload.touch(item.tenant)  # an offloaded slot is restored by this item, on every rank
        res = await self.actors.update(item, t.setup(), tuple(self.pool.push_targets()))
        self.registry.publish(item.tenant, res.version)
        for e in res.push_errors:
            m = self.pool.member_of(e.partition(":")[0])
            if m is not None:
                self.health.error(m.role, f"weight push: {e}")
        if not isinstance(item.work, OpWork) or item.work.op == "save_weights":
            self.runtime.spawn(self.pool.on_published(t.setup(), res.pushed_to))
        return update_reply(res)

    async def _send_tracker(self, address: str, calls: list[list[Any]]) -> list[Any]:
        return await self.runtime.call(address, "nexus_tracker", timeout=300, calls=calls)

    async def _flush_engine_signals(self) -> None:
        await asyncio.gather(*(self.engine_ops.flush_signals(m.endpoint) for m in self.pool.serving()),
                             return_exceptions=True)

    def _event(self, topic: str, msg: dict[str, Any]) -> None:
        self.scheduler.log_event(f"nexus-{topic}", msg)

    async def _sample_forever(self, period_s: float = 1.0) -> None:
        """Control signals over time (:func:`nexus.control.monitoring.status.control_signals`); idle op sessions end."""
        while True:
            self.monitoring.sample(status.control_signals(self.parts))
            self.op_runs.close_idle()
            self.routing.tick()
            if not self.offload.busy:
                self.runtime.spawn(self.offload.tick())
            await asyncio.sleep(period_s)

    # -- handlers (names and argument shapes are the public RPC contract) ------------------------------------
    async def create_tenant(self, spec: dict[str, Any]) -> dict[str, Any]:
        # the gateway validated the spec where it entered (catalogs, quotas): here it only becomes typed again
        return await self.lifecycle.create(TenantSpec.model_validate(spec))

    async def submit(self, tenant: str, job: dict[str, Any]) -> str:
        return self.jobs.submit(tenant, job)

    def job(self, job_id: str) -> dict[str, Any]:
        return self.jobs.view(self.jobs.get(job_id))

    async def wait(self, job_id: str, timeout: float | None = None) -> dict[str, Any]:
        return await self.jobs.wait(job_id, timeout)

    def status(self, limit: int | None = None, cursor: str | None = None, tenant: str | None = None) -> dict[str, Any]:
        """One page of the status (:mod:`nexus.wire.paging`); ``tenant``: that tenant's view only."""
        return status.build(self.parts, Page.parse(limit, cursor, tenant))

    def monitoring_view(self, since: float = 0.0, limit: int | None = None,
                        cursor: str | None = None) -> dict[str, Any]:
        """Everything the dashboard page shows: a page of the status + its tenants' signals since ``since``."""
        st = self.status(limit, cursor)
        return {"status": st, **self.monitoring.snapshot(since, [t["tenant"] for t in st["tenants"]])}

    def tenant_log(self, tenant: str) -> dict[str, Any]:
        """A tenant's jobs with their full metric histories (CLI ``logs`` and ``report``)."""
        return status.tenant_log(self.parts, tenant)

    async def op(self, tenant: str, verb: str, data: str | None = None, loss: str = "sft",
                 session: str | None = None, **options: Any) -> dict[str, Any]:
        """Low-level, Tinker-style operations, ordered through the training queue
        (:mod:`nexus.control.jobs.low_level`)."""
        return await self.ops.run(tenant, verb, data, loss, session, **options)

    async def end_sessions(self, timeout: float = 10.0) -> dict[str, Any]:
        """A stopping service calls this while its tracker still runs: jobs that ended finish recording themselves,
        every op session's MLflow run ends, and the tracker writes it all (each wait up to ``timeout``)."""
        busy, ended = await self.jobs.settle(float(timeout)), self.op_runs.close_all()
        return {"ended": ended, "still_recording": busy, "flushed": await self.tracker.flush(timeout=float(timeout))}

    async def flush(self) -> bool:
        """Wait until pending metering signals arrived and the tracker wrote everything sent so far."""
        await self._flush_engine_signals()
        await asyncio.sleep(0.5)  # the signal travels on the worker's event stream
        return await self.tracker.flush()

    # -- scheduler and accounting ----------------------------------------------------------------------
    def accounting(self, t0: float | None = None, t1: float | None = None) -> dict[str, Any]:
        """Busy time, device time and utilization per service over ``[t0, t1]`` (default: the service's life)."""
        return self.accounts.window(t0, t1)

    def scheduling(self) -> dict[str, Any]:
        return self.schedulers.view()

    async def set_scheduler(self, scheduler: dict[str, Any]) -> dict[str, Any]:
        """Apply a scheduler (a ``nexus.config.service.Scheduler`` as a dict) to a running, idle service; its T and B
        go to every serving engine too (benchmarks compare schedulers on one cluster)."""
        return await self.schedulers.switch(scheduler)

    # -- new handlers ------------------------------------------------------------------------------------------
    async def cancel(self, job_id: str) -> dict[str, Any]:
        return await self.jobs.cancel(job_id)

    async def delete_tenant(self, tenant: str, keep_output: bool = True) -> dict[str, Any]:
        t = self.registry.find(tenant)
        try:
            return await self.lifecycle.delete(tenant, keep_output)
        finally:
            if t is not None and self.registry.find(tenant) is not t:  # it left the service: its sessions end
                self.op_runs.close_tenant(tenant)
                self.offload.forget(tenant)

    async def scale_inference(self, n: int) -> dict[str, Any]:
        return await self.pool.scale(int(n))

    async def route(self, tenant: str, stale: str | None = None, error: str | None = None,
                    timeout: float | None = None) -> dict[str, Any]:
        """The inference engine serving ``tenant`` (callers ask again when theirs refused or vanished)."""
        t = self.registry.find(tenant)
        if t is None or t.phase == TenantPhase.DELETING:
            raise NotFound(f"unknown tenant {tenant!r}")
        if t.phase != TenantPhase.READY:
            await asyncio.wait_for(t.ready.wait(), timeout or 600)
        return (await self.pool.wait_route(tenant, stale, error, timeout)).to_dict()

    def engines(self) -> list[dict[str, Any]]:
        """Endpoints of the serving engines (``Nexus.engine(i)``)."""
        return [m.endpoint.to_dict() for m in self.pool.serving()]

    async def export(self, tenant: str, path: str | None = None, version: int | None = None) -> dict[str, Any]:
        """Write a tenant's policy version as a self-contained directory (:mod:`nexus.control.jobs.exports`)."""
        return await export_version(self.registry, self.actors, tenant, path, version)

    async def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
        """Wait until the actor group and at least one engine serve (and rediscovery ran)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not (self.actors.ready and self.pool.serving() and self.tracker.address
                   and self.supervisor.discovery["state"] in ("done", "failed")):
            if loop.time() > deadline:
                raise Unavailable(f"the service is not ready after {timeout:g} s: {status.service_view(self.parts)}")
            await asyncio.sleep(0.2)
        return status.service_view(self.parts)


def update_reply(res: UpdateResult) -> dict[str, Any]:
    """What a training item's caller gets back; the update's end on the actor devices' clock when it says one (the
    job's next rollout may start from it)."""
    out = {"version": res.version, "metrics": dict(res.metrics), "outputs": res.outputs}
    if res.ended_at:
        out["ended_at"] = res.ended_at
    return out
