"""The Master Service: builds the control plane's parts, wires them, and answers the RPC handlers.

===================  ==============================================================================
part                 module
===================  ==============================================================================
tenant registry      :mod:`nexus.control.tenants` (+ lifecycle: :mod:`nexus.control.lifecycle`)
jobs and flows       :mod:`nexus.control.jobs`, :mod:`nexus.control.flows`
training queue       :mod:`nexus.control.queues` + dispatcher :mod:`nexus.control.dispatcher`
actor group          :mod:`nexus.control.actors` (N ranks)
inference pool       :mod:`nexus.control.engines` (M engines, routing, scaling)
health + restarts    :mod:`nexus.control.health`, :mod:`nexus.control.supervisor`
tracking             :mod:`nexus.control.tracking_link` (the tracker itself runs on a worker)
ops' MLflow runs     :mod:`nexus.control.op_runs` (one run per client session of low-level ops)
Dask                 :mod:`nexus.control.runtime`, tasks by import path :mod:`nexus.control.tasks`
===================  ==============================================================================

Everything runs on the scheduler's event loop; nothing blocks it and nothing imports torch.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from nexus.config import ServiceConfig
from nexus.control import flows, status, tasks
from nexus.control.actors import ActorGroup
from nexus.control.dispatcher import Dispatcher, DispatchPolicy
from nexus.control.engines import EnginePool, PoolPolicy
from nexus.control.health import HealthManager, HealthPolicy
from nexus.control.jobs import JobManager
from nexus.control.lifecycle import TenantLifecycle
from nexus.control.monitoring import MonitoringState
from nexus.control.op_runs import OpRuns
from nexus.control.queues import TrainingItem, TrainingQueue
from nexus.control.runtime import DaskRuntime
from nexus.control.supervisor import DaskEngineOps, Supervisor
from nexus.control.tenants import TenantRegistry
from nexus.control.tracking_link import TrackerLink
from nexus.data.output_dir import TenantOutputDir
from nexus.errors import NotFound, SpecError, Unavailable
from nexus.messages import UpdateRequest
from nexus.spec import check_session

logger = logging.getLogger("nexus.master")


class Master:
    def __init__(self, config: ServiceConfig, scheduler) -> None:
        self.config = config
        self.scheduler = scheduler
        self.runtime = DaskRuntime(scheduler, config)
        self.monitoring = MonitoringState()
        self.health = HealthManager(HealthPolicy.from_settings(config.health))
        self.registry = TenantRegistry()
        self.queue = TrainingQueue(config.dispatch.queue_order)
        self.actors = ActorGroup(self.runtime, config.actor_ranks)
        self.engine_ops = DaskEngineOps(self.runtime, config)
        self.pool = EnginePool(self.engine_ops, lambda: [t.setup() for t in self.registry if t.phase == "ready"],
                               PoolPolicy(engines=config.inference_engines), self.health)
        self.dispatcher = Dispatcher(self.queue, self._execute, self.registry.versions,
                                     DispatchPolicy.from_settings(config.dispatch), lambda: self.actors.ready)
        self.tracker = TrackerLink(self._send_tracker)
        self.tracker.on_error = lambda e: self.health.error("tracker", e)
        self.op_runs = OpRuns(self.tracker, config.ops_idle_s)
        ctx = flows.FlowContext(self.dispatcher, self.queue, self.pool, self.health, self.runtime,
                                config.dispatch.rollout_attempts, log=lambda *a: None, datapath=config.datapath,
                                eval_fanout=config.dispatch.eval_fanout)
        self.jobs = JobManager(self.registry, ctx, self.actors, self.runtime, self.tracker, self.monitoring,
                               self._event, self._flush_engine_signals, config.limits_for,
                               isolated=config.dispatch.isolated)
        self.lifecycle = TenantLifecycle(config, self.registry, self.actors, self.pool, self.dispatcher, self.jobs,
                                         self._event)
        self.supervisor = Supervisor(config, self.runtime, self.health, self.actors, self.pool, self.registry,
                                     self.tracker, self.dispatcher)
        self.supervisor.lifecycle, self.supervisor.jobs = self.lifecycle, self.jobs
        self._sampler: asyncio.Task | None = None

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
        engines = tuple(self.pool.push_targets())
        res = await self.actors.run(
            tasks.RUN_UPDATE, lambda r: (UpdateRequest(item.to_dict(), t.setup(), engines, r, self.actors.world_size),
                                         item.data),
            key=f"nexus-update-{item.item_id}")
        self.registry.publish(item.tenant, res.version)
        for e in res.push_errors:
            m = self.pool.member_of(e.partition(":")[0])
            if m is not None:
                self.health.error(m.role, f"weight push: {e}")
        if item.kind != "op" or item.payload.get("op") == "save_weights":
            self.runtime.spawn(self.pool.on_published(t.setup(), res.pushed_to))
        return {"version": res.version, "metrics": dict(res.metrics)}

    async def _send_tracker(self, address: str, calls: list[list[Any]]) -> list[Any]:
        return await self.runtime.call(address, "nexus_tracker", timeout=300, calls=calls)

    async def _flush_engine_signals(self) -> None:
        await asyncio.gather(*(self.engine_ops.flush_signals(m.endpoint) for m in self.pool.serving()),
                             return_exceptions=True)

    def _event(self, topic: str, msg: dict[str, Any]) -> None:
        self.scheduler.log_event(f"nexus-{topic}", msg)

    async def _sample_forever(self, period_s: float = 1.0) -> None:
        """Control signals over time: queue depths, in-flight and version lag per tenant."""
        while True:
            versions = self.registry.versions()
            self.monitoring.sample({
                "training_depth": len(self.queue), "inference_pending": self.monitoring.inference_pending,
                "by_tenant": {n: {"queued": c.queued, "inflight": c.inflight, "version": versions.get(n, 0)}
                              for n, c in self.queue.counters.items()},
                "lag": self.queue.lags(versions)})
            self.op_runs.close_idle()
            await asyncio.sleep(period_s)

    # -- handlers (names and argument shapes are the public RPC contract) ------------------------------------
    async def create_tenant(self, spec: dict[str, Any]) -> dict[str, Any]:
        return await self.lifecycle.create(spec)

    async def submit(self, tenant: str, job: dict[str, Any]) -> str:
        return self.jobs.submit(tenant, job)

    def job(self, job_id: str) -> dict[str, Any]:
        return self.jobs.view(self.jobs.get(job_id))

    async def wait(self, job_id: str, timeout: float | None = None) -> dict[str, Any]:
        return await self.jobs.wait(job_id, timeout)

    def status(self) -> dict[str, Any]:
        return status.build(self)

    def monitoring_view(self, since: float = 0.0) -> dict[str, Any]:
        """Everything the dashboard page shows: status + signals since ``since``."""
        return {"status": self.status(), **self.monitoring.snapshot(since)}

    def tenant_log(self, tenant: str) -> dict[str, Any]:
        """A tenant's jobs with their full metric histories (CLI ``logs`` and ``report``)."""
        t = self.registry.get(tenant)
        return {"tenant": t.view(), "t_start": self.monitoring.t_start,
                "jobs": [{**self.jobs.view(self.jobs.jobs[j]), "history": self.jobs.jobs[j].history}
                         for j in t.jobs if j in self.jobs.jobs],
                "spans": [vars(sp) for sp in self.monitoring.spans]}

    async def op(self, tenant: str, verb: str, data: str | None = None, loss: str = "sft",
                 session: str | None = None) -> dict[str, Any]:
        """Low-level, Tinker-style operations, ordered through the training queue.

        ``data`` names a dataset published by the client (its payload never passes through here).
        ``session``: the calling client's connection id (``Nexus.session``; None: the tenant's default
        session); a session's ops are one MLflow run (:mod:`nexus.control.op_runs`)."""
        if verb not in ("forward_backward", "optim_step", "save_weights"):
            raise SpecError(f"unknown op {verb!r}: forward_backward, optim_step or save_weights")
        if verb == "forward_backward" and loss not in ("sft", "ppo", "grpo"):
            raise SpecError(f"unknown loss {loss!r}: 'sft', 'ppo' or 'grpo'")
        session = check_session(session)
        t = self.registry.get(tenant)
        client = await self.runtime.client()
        fut = None
        if verb == "forward_backward":
            if data is None:
                raise SpecError("forward_backward needs a batch")
            fut = await client.get_dataset(data)
        token, res = self.op_runs.begin(tenant, session), None
        try:
            res = await flows.run_op(self.jobs.ctx, t, verb, loss, fut)
        finally:
            alive = self.registry.find(tenant) is t and t.phase != "deleting"  # a deleted tenant's: not recorded
            self.op_runs.finish(token, verb, res if alive else None, lambda: t.spec.model_dump(),
                                lambda v: str(TenantOutputDir(t.output_dir).weights_path(v)))
        if data is not None:
            await client.unpublish_dataset(data)
        return res

    async def end_sessions(self, timeout: float = 10.0) -> dict[str, Any]:
        """End every low-level op session's MLflow run now and wait (up to ``timeout``) until the tracker
        wrote it: a stopping service calls this while its tracker still runs."""
        ended = self.op_runs.close_all()
        flushed = await self.tracker.flush(timeout=float(timeout)) if ended else True
        return {"ended": ended, "flushed": flushed}

    async def flush(self) -> bool:
        """Wait until pending metering signals arrived and the tracker wrote everything sent so far."""
        await self._flush_engine_signals()
        await asyncio.sleep(0.5)  # the signal travels on the worker's event stream
        return await self.tracker.flush()

    # -- scheduling policy and accounting ----------------------------------------------------------------------
    def slots(self) -> dict[str, list[str]]:
        """Workers allocated to each service now (actor ranks, serving engines' workers, SIM workers)."""
        names = {addr: str(ws.name) for addr, ws in self.scheduler.workers.items()}
        return {"actor": [str(w) for w in self.actors.workers],
                "inference": sorted({names.get(m.worker, str(m.worker)) for m in self.pool.serving()}),
                "simulator": sorted(str(ws.name) for ws in self.scheduler.workers.values() if "SIM" in ws.resources)}

    def worker_aliases(self) -> dict[str, str]:
        """Worker address -> name: signals name their worker by address, slots by name."""
        return {addr: str(ws.name) for addr, ws in self.scheduler.workers.items()}

    def accounting(self, t0: float | None = None, t1: float | None = None) -> dict[str, Any]:
        """Busy time, device time and utilization per service over ``[t0, t1]`` (default: the service's life)."""
        return self.monitoring.accounting(self.slots(), t0, t1, self.worker_aliases())

    def scheduling(self) -> dict[str, Any]:
        return {"policy": self.config.scheduler_policy.model_dump() if self.config.scheduler_policy else None,
                "admission": self.jobs.admission.view(), "queue_order": self.queue.order}

    async def set_policy(self, policy: dict[str, Any]) -> dict[str, Any]:
        """Switch the scheduling policy of a running, idle service (benchmarks compare policies on one
        cluster). Its T and B go to every serving engine (and to engines started later)."""
        from nexus.errors import Conflict
        from nexus.scheduling import SchedulerPolicy

        try:
            pol = SchedulerPolicy.model_validate(policy)
        except Exception as e:
            raise SpecError(f"invalid scheduler policy: {e}") from None
        busy = [j.job_id for j in self.jobs.jobs.values() if not j.finished.is_set()]
        if busy or len(self.queue) or self.dispatcher.running:
            raise Conflict(f"the policy changes only while no job runs (running or queued: {busy})")
        cfg = self.config
        if pol.default_max_inflight > cfg.limits.max_inflight:
            raise SpecError(f"scheduler {pol.name!r}: default_max_inflight {pol.default_max_inflight} exceeds "
                            f"limits.max_inflight {cfg.limits.max_inflight}")
        if (pol.infer_max_wait_s, pol.infer_max_batch) != (cfg.infer_max_wait_s, cfg.infer_max_batch):
            cfg.infer_max_wait_s, cfg.infer_max_batch = pol.infer_max_wait_s, pol.infer_max_batch  # later engines
            pushed = await asyncio.gather(*(self.engine_ops.set_batching(m.endpoint, pol.infer_max_wait_s,
                                                                         pol.infer_max_batch)
                                            for m in self.pool.serving()), return_exceptions=True)
            for e in pushed:  # an engine lost meanwhile restarts with the new values from the config
                if isinstance(e, BaseException):
                    logger.warning("scheduler %r: an engine kept its old T/B: %s", pol.name, e)
        cfg.dispatch = cfg.dispatch.model_copy(update={
            "queue_order": pol.queue_order, "isolated": pol.isolated, "eval_fanout": pol.eval_fanout,
            "max_concurrent_updates": pol.max_concurrent_updates, "default_max_inflight": pol.default_max_inflight,
            "default_max_staleness": pol.default_max_staleness})
        cfg.datapath = cfg.datapath.model_copy(update={"sync_policy": pol.sync_policy, "sync_every": pol.sync_every})
        cfg.scheduler, cfg.scheduler_policy = pol.name, pol
        self.queue.order = pol.queue_order  # empty queue: no rank to recompute
        self.dispatcher.policy = DispatchPolicy.from_settings(cfg.dispatch)
        self.jobs.ctx.eval_fanout, self.jobs.ctx.datapath = pol.eval_fanout, cfg.datapath
        self.jobs.admission.set_isolated(pol.isolated)
        return self.scheduling()

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

    async def scale_inference(self, n: int) -> dict[str, Any]:
        return await self.pool.scale(int(n))

    async def route(self, tenant: str, stale: str | None = None, error: str | None = None,
                    timeout: float | None = None) -> dict[str, Any]:
        """The inference engine serving ``tenant`` (callers ask again when theirs refused or vanished)."""
        t = self.registry.find(tenant)
        if t is None or t.phase == "deleting":
            raise NotFound(f"unknown tenant {tenant!r}")
        if t.phase != "ready":
            await asyncio.wait_for(t.ready.wait(), timeout or 600)
        return (await self.pool.wait_route(tenant, stale, error, timeout)).to_dict()

    def engines(self) -> list[dict[str, Any]]:
        """Endpoints of the serving engines (``Nexus.engine(i)``)."""
        return [m.endpoint.to_dict() for m in self.pool.serving()]

    async def export(self, tenant: str, path: str | None = None, version: int | None = None) -> dict[str, Any]:
        """Write a tenant's policy version (default: current) as a self-contained directory (``nexus.policy``).

        ``path`` None: the tenant's own ``<output dir>/exports/vNNNNNN/`` (written once, reused after), which
        the gateway serves as the tenant's files; else an absolute path on the service's file system (the
        gateway lets tenant tokens name only paths inside their output dir). Runs on actor rank 0 (the
        backbone the policy ran on is resident there) from that version's durable weights file, so training
        may go on meanwhile."""
        t = self.registry.get(tenant)
        version = t.version if version is None else int(version)
        if not 0 <= version <= t.version:
            raise NotFound(f"tenant {tenant!r} has no version {version} (current {t.version})")
        if path is not None and (not isinstance(path, str) or "\x00" in path or not os.path.isabs(path)):
            raise SpecError(f"export path {path!r}: give an absolute path on the service's file system")
        setup = t.setup()
        return await self.actors.run(
            tasks.EXPORT_VERSION, lambda r: (setup.spec, setup.schema, setup.output_dir, version, path, r),
            key=f"nexus-export-{tenant}-v{version}", retry_lost=True, timeout=600)

    async def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
        """Wait until the actor group and at least one engine serve (and rediscovery ran)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not (self.actors.ready and self.pool.serving() and self.tracker.address
                   and self.supervisor.discovery["state"] in ("done", "failed")):
            if loop.time() > deadline:
                raise Unavailable(f"the service is not ready after {timeout:g} s: {status.service_view(self)}")
            await asyncio.sleep(0.2)
        return status.service_view(self)
