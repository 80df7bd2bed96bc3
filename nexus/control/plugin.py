"""NexusPlugin: the Master Service and the two queues, inside the Dask scheduler.

One plugin class; its RPC handlers are registered in one place (:meth:`NexusPlugin.start`).
It validates tenant specs, keeps tenants' state and policy versions, turns SFT / RL / Eval jobs
into task graphs (rollouts on ``SIM`` workers, updates on the ``ACTOR`` worker) and routes
tenants to the inference engine (an actor on an ``INFER`` worker).

Rules of this module: nothing blocking runs on the scheduler's event loop (no file I/O, no
MLflow), and torch is never imported here — worker-side functions are named by import path and
their modules import torch lazily.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from tornado import web

from nexus.config import ServiceConfig
from nexus.control import dashboard
from nexus.control.monitoring import SERVICES, TOPIC, MonitoringState, PrometheusCollector
from nexus.control.queues import TenantLimits, TrainingItem, TrainingQueue
from nexus.control.validation import SpecError, schema_to_dict, validate_job, validate_tenant
from nexus.data.output_dir import mark_evaluation
from nexus.features import TenantSchema
from nexus.services import rollout, tracking
from nexus.services import training as training_service
from nexus.services.inference import InferenceEngine
from nexus.spec import EvalJob, RLJob, SFTJob, TenantSpec

logger = logging.getLogger("nexus.scheduler")

ENGINE_DATASET = "nexus-inference-engine"


@dataclass
class TenantState:
    spec: TenantSpec
    schema: TenantSchema
    output_dir: str
    version: int = 0
    training_job: str | None = None  # at most one SFT/RL job at a time; evals run beside it
    episodes: int = 0  # RL episodes started so far: ids and reset seeds never repeat
    jobs: list[str] = field(default_factory=list)

    def view(self) -> dict[str, Any]:
        kind = "rl" if self.spec.env and not self.spec.dataset else "sft" if self.spec.dataset else "eval"
        return {"tenant": self.spec.name, "kind": kind, "version": self.version,
                "env": self.spec.env, "dataset": self.spec.dataset, "output_dir": self.output_dir,
                "training_job": self.training_job, "jobs": list(self.jobs)}


@dataclass
class JobState:
    job_id: str
    tenant: str
    spec: SFTJob | RLJob | EvalJob
    state: str = "queued"  # queued -> running -> done | failed
    progress: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    error: str | None = None
    t_submit: float = field(default_factory=time.time)
    t_end: float | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    def view(self) -> dict[str, Any]:
        return {"job": self.job_id, "tenant": self.tenant, "kind": self.spec.kind, "state": self.state,
                "spec": self.spec.model_dump(), "progress": dict(self.progress), "result": self.result,
                "error": self.error, "t_submit": self.t_submit, "t_end": self.t_end}


class NexusPlugin(SchedulerPlugin):
    name = "nexus"

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.scheduler = None
        self.queue = TrainingQueue()
        self.tenants: dict[str, TenantState] = {}
        self.jobs: dict[str, JobState] = {}
        self._client = None
        self._client_lock: asyncio.Lock | None = None
        self._engine = None  # (future, Actor proxy) of the inference engine
        self._tracker = None  # (future, Actor proxy) of the MLflow tracker
        self._actor_busy = 0
        self._waiters: dict[str, asyncio.Future] = {}
        self._runners: set[asyncio.Task] = set()
        self._freed: dict[str, asyncio.Event] = {}
        self._seq = 0
        self.monitoring = MonitoringState()
        self._sampler: asyncio.Task | None = None

    # ------------------------------------------------------------------------- lifecycle
    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self._client_lock = asyncio.Lock()
        scheduler.handlers.update({
            "nexus_create_tenant": self.create_tenant,
            "nexus_submit": self.submit,
            "nexus_job": self.job,
            "nexus_wait": self.wait,
            "nexus_status": self.status,
            "nexus_op": self.op,
            "nexus_flush": self.flush,
            "nexus_monitoring": self.monitoring_view,
            "nexus_tenant_log": self.tenant_log,
        })
        scheduler.get_task_stream(count=0)  # record task start/stops from the start (dashboard, metering checks)
        self._sampler = asyncio.get_running_loop().create_task(self._sample_forever())
        _register_prometheus(self)
        http = getattr(scheduler, "http_application", None)
        if http is not None:  # JSON view of the service next to the dashboard
            http.add_handlers(r".*", [(r"/nexus/api/state", _StateHandler, {"plugin": self})])
        logger.info("Nexus plugin started on %s (service root %s)", scheduler.address, self.config.root)

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
        for t in list(self._runners):
            t.cancel()
        if self._client is not None:
            await self._client.close()

    async def _get_client(self):
        """An asynchronous Client in the scheduler's own event loop (scheduler-side submission)."""
        async with self._client_lock:
            if self._client is None:
                from distributed import Client

                # the default client of this process: Actor proxies bind to it (get_client())
                self._client = await Client(self.scheduler.address, asynchronous=True,
                                            name="nexus-master", set_as_default=True)
            return self._client

    async def _services(self):
        """Start the inference engine and the tracker once (actors on workers)."""
        client = await self._get_client()
        if self._engine is None:
            fut = client.submit(InferenceEngine, self.config.model_dump(), actor=True,
                                resources={"INFER": 1}, key="nexus-inference-engine-0")
            self._engine = (fut, await fut)
            await client.publish_dataset(fut, name=ENGINE_DATASET, override=True)
        if self._tracker is None:
            fut = client.submit(tracking.Tracker, self.config.model_dump(), actor=True,
                                resources={"INFER": 1}, key="nexus-tracker-0")
            self._tracker = (fut, await fut)
        return client, self._engine[1], self._tracker[1]

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._runners.add(task)
        task.add_done_callback(self._runners.discard)
        return task

    # ------------------------------------------------------------------------- handlers
    async def create_tenant(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Validate a tenant spec and allocate its slot on the actor and the inference engine."""
        spec_, schema = validate_tenant(spec)
        if spec_.name in self.tenants:
            existing = self.tenants[spec_.name]
            if existing.spec != spec_:
                raise SpecError(f"tenant {spec_.name!r} exists with another spec")
            return existing.view()
        client, engine, _ = await self._services()
        output_dir = spec_.output_dir or str(self.config.tenants_dir / spec_.name)
        fut = client.submit(training_service.init_tenant, spec_.model_dump(), schema_to_dict(schema),
                            output_dir, engine, resources={"ACTOR": 1}, pure=False,
                            key=f"nexus-init-{spec_.name}-{self._next()}")
        info = await fut
        state = TenantState(spec=spec_, schema=schema, output_dir=output_dir, version=info["version"])
        self.tenants[spec_.name] = state
        self.queue.set_limits(spec_.name, TenantLimits(spec_.max_inflight, spec_.max_staleness, spec_.priority))
        self._event("tenant", {"tenant": spec_.name, "version": state.version, "restored": info["restored"]})
        return state.view()

    async def submit(self, tenant: str, job: dict[str, Any]) -> str:
        t = self._tenant(tenant)
        job_ = validate_job(t.spec, job)
        if job_.kind in ("sft", "rl") and t.training_job is not None:
            raise SpecError(f"tenant {tenant!r} already runs training job {t.training_job!r}")
        if job_.kind == "eval" and job_.version is not None and job_.version > t.version:
            raise SpecError(f"tenant {tenant!r} has no version {job_.version} yet (current {t.version})")
        js = JobState(job_id=f"{tenant}-{job_.kind}-{self._next()}", tenant=tenant, spec=job_)
        self.jobs[js.job_id] = js
        t.jobs.append(js.job_id)
        if job_.kind in ("sft", "rl"):
            t.training_job = js.job_id
        self._spawn(self._run_job(js))
        return js.job_id

    def job(self, job_id: str) -> dict[str, Any]:
        return self._job_view(self._job(job_id))

    def _job_view(self, js: JobState) -> dict[str, Any]:
        return {**js.view(), "metered_s": self.monitoring.job_metering(js.job_id)}

    async def wait(self, job_id: str, timeout: float | None = None) -> dict[str, Any]:
        js = self._job(job_id)
        try:
            await asyncio.wait_for(js.finished.wait(), timeout)
        except TimeoutError:
            pass
        return self._job_view(js)

    def status(self) -> dict[str, Any]:
        versions = {n: t.version for n, t in self.tenants.items()}
        metering = self.monitoring.metering_table()
        tenants = []
        for name, t in self.tenants.items():
            c = self.queue.counters.get(name)
            state = "training" if t.training_job else "evaluating" if any(
                self.jobs[j].state == "running" for j in t.jobs) else "idle"
            tenants.append({**t.view(), "state": state, "inflight": c.inflight if c else 0,
                            "queued": c.queued if c else 0, "running": c.running if c else 0,
                            "dropped_stale": c.dropped_stale if c else 0,
                            "max_inflight_seen": c.max_inflight_seen if c else 0,
                            "metered_s": metering.get(name, {s: 0.0 for s in SERVICES})})
        now = time.time()
        workers = [{"name": str(ws.name), "address": ws.address, "status": ws.status.name,
                    "resources": dict(ws.resources), "since_heartbeat_s": round(now - ws.last_seen, 3),
                    "processing": len(ws.processing)} for ws in self.scheduler.workers.values()]
        return {"tenants": tenants, "jobs": [self._job_view(j) for j in self.jobs.values()],
                "training_queue": {"depth": len(self.queue), "by_tenant": self.queue.depth(),
                                   "lag": self.queue.lags(versions)},
                "inference_queue": {"pending": self.monitoring.inference_pending},
                "workers": workers, "busy_s": dict(self.monitoring.busy),
                "actor_busy": self._actor_busy, "config": self.config.model_dump()}

    def monitoring_view(self, since: float = 0.0) -> dict[str, Any]:
        """Everything the dashboard page shows: status + signals since ``since``."""
        return {"status": self.status(), **self.monitoring.snapshot(since)}

    def tenant_log(self, tenant: str) -> dict[str, Any]:
        """A tenant's jobs with their full metric histories (CLI ``logs`` and ``report``)."""
        t = self._tenant(tenant)
        return {"tenant": t.view(), "t_start": self.monitoring.t_start,
                "jobs": [{**self._job_view(self.jobs[j]), "history": self.jobs[j].history} for j in t.jobs],
                "spans": [vars(sp) for sp in self.monitoring.spans]}

    def log_event(self, topic: str, msg: Any) -> None:
        if topic == TOPIC and isinstance(msg, dict):
            self.monitoring.ingest(msg)

    async def _sample_forever(self, period_s: float = 1.0) -> None:
        """Control signals over time: queue depths, in-flight and version lag per tenant."""
        while True:
            versions = {n: t.version for n, t in self.tenants.items()}
            self.monitoring.sample({
                "training_depth": len(self.queue), "inference_pending": self.monitoring.inference_pending,
                "by_tenant": {n: {"queued": c.queued, "inflight": c.inflight, "version": versions.get(n, 0)}
                              for n, c in self.queue.counters.items()},
                "lag": self.queue.lags(versions)})
            await asyncio.sleep(period_s)

    async def op(self, tenant: str, verb: str, data: str | None = None, loss: str = "sft") -> dict[str, Any]:
        """Low-level, Tinker-style operations, ordered through the training queue.

        ``data`` names a dataset published by the client (its payload never passes through here).
        """
        if verb not in ("forward_backward", "optim_step", "save_weights"):
            raise SpecError(f"unknown op {verb!r}: forward_backward, optim_step or save_weights")
        if verb == "forward_backward" and loss not in ("sft", "ppo", "grpo"):
            raise SpecError(f"unknown loss {loss!r}: 'sft', 'ppo' or 'grpo'")
        t = self._tenant(tenant)
        client = await self._get_client()
        fut = None
        if verb == "forward_backward":
            if data is None:
                raise SpecError("forward_backward needs a batch")
            fut = await client.get_dataset(data)
        while not self.queue.reserve(tenant):
            await self._until_freed(tenant)
        item = TrainingItem(tenant=tenant, kind="op", policy_version=t.version,
                            payload={"op": verb, "loss": loss, "data": fut})
        res = await self._enqueue(item)
        if data is not None:
            await client.unpublish_dataset(data)
        return res

    async def flush(self) -> bool:
        """Wait until pending metering signals arrived and the tracker wrote everything sent so far."""
        if self._engine is not None:
            await self._engine[1].flush_signals()
            await asyncio.sleep(0.5)  # the signal travels on the worker's event stream
        if self._tracker is not None:
            await self._tracker[1].flush()
        return True

    # ------------------------------------------------------------------------- helpers
    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _tenant(self, name: str) -> TenantState:
        if name not in self.tenants:
            raise SpecError(f"unknown tenant {name!r}")
        return self.tenants[name]

    def _job(self, job_id: str) -> JobState:
        if job_id not in self.jobs:
            raise SpecError(f"unknown job {job_id!r}")
        return self.jobs[job_id]

    def _event(self, topic: str, msg: dict[str, Any]) -> None:
        self.scheduler.log_event(f"nexus-{topic}", msg)

    async def _until_freed(self, tenant: str) -> None:
        """Sleep until one of the tenant's training items finishes (its admission slot frees)."""
        ev = self._freed.setdefault(tenant, asyncio.Event())
        await ev.wait()

    def _notify_freed(self, tenant: str) -> None:
        ev = self._freed.pop(tenant, None)
        if ev is not None:
            ev.set()

    # ------------------------------------------------------------------------- training queue
    async def _enqueue(self, item: TrainingItem) -> dict[str, Any]:
        """Put a reserved item on the training queue; resolves with the update's result."""
        self.queue.put(item)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[item.item_id] = waiter
        self._pump()
        return await waiter

    def _pump(self) -> None:
        """Dispatch queued items to the actor while it has capacity (one update at a time)."""
        versions = {n: t.version for n, t in self.tenants.items()}
        while self._actor_busy < 1:
            item, dropped = self.queue.pop(versions)
            for d in dropped:
                self._resolve(d, {"dropped": True, "lag": versions[d.tenant] - d.policy_version})
                self._notify_freed(d.tenant)
            if item is None:
                return
            self._actor_busy += 1
            self._spawn(self._run_item(item))

    async def _run_item(self, item: TrainingItem) -> None:
        t = self.tenants[item.tenant]
        client, engine, _ = await self._services()
        try:
            fut = client.submit(training_service.run_item, item.to_dict(), t.spec.model_dump(),
                                schema_to_dict(t.schema), t.output_dir, engine,
                                resources={"ACTOR": 1}, pure=False, key=f"nexus-update-{item.item_id}")
            res = await fut
            t.version = max(t.version, res.get("version", t.version))
            self._resolve(item, res)
        except Exception as e:  # the job that owns the item decides what an error means
            self._resolve(item, e)
        finally:
            self.queue.done(item)
            self._actor_busy -= 1
            self._notify_freed(item.tenant)
            self._pump()

    def _resolve(self, item: TrainingItem, res: dict[str, Any] | Exception) -> None:
        w = self._waiters.pop(item.item_id, None)
        if w is not None and not w.done():
            if isinstance(res, Exception):
                w.set_exception(res)
            else:
                w.set_result(res)

    # ------------------------------------------------------------------------- jobs
    async def _run_job(self, js: JobState) -> None:
        t = self.tenants[js.tenant]
        js.state = "running"
        self._event("job", {"job": js.job_id, "state": "running"})
        try:
            _, _, tracker = await self._services()
            run_params = {**t.spec.model_dump(), **{f"job.{k}": v for k, v in js.spec.model_dump().items()}}
            # an evaluation is a nested run under the tenant's latest training job
            parent = next((j for j in reversed(t.jobs) if self.jobs[j].spec.kind != "eval"), None)
            tracker.start_run(js.job_id, js.tenant, js.spec.kind, run_params,
                              parent if js.spec.kind == "eval" else None, js.t_submit)
            runner = {"sft": self._run_sft, "rl": self._run_rl, "eval": self._run_eval}[js.spec.kind]
            js.result = await runner(js, t)
            js.state = "done"
        except asyncio.CancelledError:
            js.state, js.error = "failed", "cancelled"
            raise
        except Exception as e:
            js.state, js.error = "failed", f"{type(e).__name__}: {e}"
            logger.error("job %s failed:\n%s", js.job_id, traceback.format_exc())
        finally:
            js.t_end = time.time()
            if t.training_job == js.job_id:
                t.training_job = None
            try:
                await self._finish_job(js, t)
            finally:
                js.finished.set()
                self._event("job", {"job": js.job_id, "state": js.state, "error": js.error})

    async def _finish_job(self, js: JobState, t: TenantState) -> None:
        """Checkpoint (training jobs), record the job in the manifest, close the MLflow run."""
        client, _, tracker = await self._services()
        record = {k: v for k, v in js.view().items() if k != "spec"} | {"spec": js.spec.model_dump(),
                                                                        "history": js.history}
        # MLflow gets the weights of the version this job evaluated or produced (ux: tracking)
        version = (js.result or js.progress).get("version")
        artifacts: list[str] = []
        try:
            fut = client.submit(training_service.finish_job, js.tenant, t.output_dir, record,
                                js.spec.kind in ("sft", "rl"), version, resources={"ACTOR": 1}, pure=False,
                                key=f"nexus-finish-{js.job_id}")
            artifacts = (await fut)["artifacts"]
        except Exception as e:
            logger.error("could not record job %s: %s", js.job_id, e)
        if js.result and js.result.get("report_path"):
            artifacts.append(js.result["report_path"])
        if self._engine is not None:
            await self._engine[1].flush_signals()
        tracker.end_run(js.job_id, js.state, artifacts, js.result or {}, js.history,
                        self.monitoring.job_metering(js.job_id), js.t_end)

    def _log(self, js: JobState, metrics: dict[str, float], step: int, kind: str) -> None:
        """One history row (``nexus.history``: kind train / rollout / eval / queue, a monotonic step per kind)."""
        js.progress.update({k: v for k, v in metrics.items() if not (kind == "rollout" and k == "version")})
        js.history.append({"kind": kind, "step": step, **metrics})
        self._tracker[1].log_metrics(js.job_id, metrics, step, kind)

    def _log_update(self, js: JobState, res: dict[str, Any], **counters: int) -> None:
        self._log(js, {**res["metrics"], **counters, "version": res["version"]}, res["version"], "train")

    # SFT: ready batches from the offline dataset; back-pressure from the tenant's in-flight cap.
    async def _run_sft(self, js: JobState, t: TenantState) -> dict[str, Any]:
        spec: SFTJob = js.spec  # type: ignore[assignment]
        pending: set[asyncio.Future] = set()
        done_steps = 0
        js.progress.update(steps=0, version=t.version)
        # the held-out error costs several steps' compute (flow experts integrate an ODE): ~60 points a job
        heldout_every = max(10, spec.steps // 60)
        for k in range(spec.steps):
            while not self.queue.reserve(t.spec.name):
                await self._until_freed(t.spec.name)
            item = TrainingItem(tenant=t.spec.name, kind="sft", policy_version=t.version,
                                payload={"job": js.job_id, "dataset": t.spec.dataset, "step": k,
                                         "batch_size": spec.batch_size,
                                         "eval_heldout": k == spec.steps - 1 or k % heldout_every == 0})
            pending.add(asyncio.ensure_future(self._enqueue(item)))
            finished = {f for f in pending if f.done()}
            for f in sorted(finished, key=lambda f: f.result()["version"]):  # monotonic steps
                done_steps += 1
                self._log_update(js, f.result(), steps=done_steps)
            pending -= finished
        for f in asyncio.as_completed(pending):
            done_steps += 1
            self._log_update(js, await f, steps=done_steps)
        return {"version": t.version, "steps": done_steps, **js.progress}

    # RL: rollouts of the current policy on SIM workers overlap with updates on the actor.
    async def _run_rl(self, js: JobState, t: TenantState) -> dict[str, Any]:
        spec: RLJob = js.spec  # type: ignore[assignment]
        client, engine, _ = await self._services()
        name = t.spec.name
        updates = dropped = episodes = env_steps = 0
        rollouts: set[asyncio.Future] = set()
        items: set[asyncio.Future] = set()
        js.progress.update(updates=0, version=t.version, dropped_stale=0, episodes=0)

        async def collect(offset: int) -> dict[str, Any]:
            fut = client.submit(rollout.collect, name, t.spec.env, t.output_dir, schema_to_dict(t.schema),
                                spec.episodes_per_batch, t.spec.seed * 1_000_003, offset, False, None, engine,
                                js.job_id, resources={"SIM": 1}, pure=False, key=f"nexus-rollout-{js.job_id}-{offset}")
            return await fut

        try:
            while updates < spec.updates:
                while (len(rollouts) < spec.collectors and updates + len(items) + len(rollouts) < spec.updates
                       and self.queue.reserve(name)):
                    rollouts.add(asyncio.ensure_future(collect(t.episodes)))
                    t.episodes += spec.episodes_per_batch
                if not rollouts and not items:
                    await self._until_freed(name)
                    continue
                finished, _ = await asyncio.wait(rollouts | items, return_when=asyncio.FIRST_COMPLETED)
                for f in finished:
                    if f in rollouts:
                        rollouts.discard(f)
                        out = f.result()
                        episodes += out["stats"]["episodes"]
                        env_steps += out["stats"]["steps"]
                        self._log(js, {"return": out["stats"]["mean_return"],
                                       "success_rate": out["stats"]["success_rate"], "episodes": episodes,
                                       "env_steps": env_steps, "version": out["batch"]["policy_version"]},
                                  env_steps, "rollout")
                        item = TrainingItem(tenant=name, kind="rl", policy_version=out["batch"]["policy_version"],
                                            payload={"job": js.job_id, "batch": out["batch"],
                                                     "ppo": spec.ppo.model_dump()})
                        items.add(asyncio.ensure_future(self._enqueue(item)))
                    else:
                        items.discard(f)
                        res = f.result()
                        if res.get("dropped"):
                            dropped += 1
                            self._log(js, {"dropped_stale": dropped}, dropped, "queue")
                        else:
                            updates += 1
                            self._log_update(js, res, updates=updates)
        finally:
            for f in rollouts | items:
                f.cancel()
            for _ in rollouts:
                self.queue.cancel_reservation(name)
        return {"version": t.version, "updates": updates, "dropped_stale": dropped, "episodes": episodes,
                "env_steps": env_steps, **{k: js.progress[k] for k in ("return", "success_rate") if k in js.progress}}

    # Eval: pins a version, runs the inference engine + simulators only; no training-queue entries.
    async def _run_eval(self, js: JobState, t: TenantState) -> dict[str, Any]:
        spec: EvalJob = js.spec  # type: ignore[assignment]
        client, engine, _ = await self._services()
        version = t.version if spec.version is None else spec.version
        js.progress.update(version=version, episodes=0)
        # retention keeps every evaluated version: mark it before anything can prune it (ux: retention)
        await client.submit(mark_evaluation, t.output_dir, js.job_id, version, pure=False,
                            resources={"INFER": 1}, key=f"nexus-evalmark-{js.job_id}")
        await engine.pin(t.spec.name, version, t.output_dir)
        try:
            n_tasks = min(spec.episodes, 2)
            shares = [spec.episodes // n_tasks + (i < spec.episodes % n_tasks) for i in range(n_tasks)]
            futs = [client.submit(rollout.collect, t.spec.name, t.spec.env, t.output_dir,
                                  schema_to_dict(t.schema), n, 7_000_003 * (1 + t.spec.seed),
                                  sum(shares[:i]), spec.deterministic, version, engine, js.job_id,
                                  resources={"SIM": 1}, pure=False, key=f"nexus-eval-{js.job_id}-{i}")
                    for i, n in enumerate(shares)]
            outs = await client.gather(futs)
        finally:
            await engine.unpin(t.spec.name, version)
        stats = rollout.merge_stats([o["stats"] for o in outs])
        versions_seen = sorted({v for o in outs for v in o["versions"]})
        report = {"tenant": t.spec.name, "job": js.job_id, "version": version, "versions_seen": versions_seen,
                  **stats}
        fut = client.submit(rollout.write_eval_report, t.output_dir, report, pure=False,
                            resources={"SIM": 1}, key=f"nexus-evalreport-{js.job_id}")
        report["report_path"] = await fut
        self._log(js, {"success_rate": stats["success_rate"], "return": stats["mean_return"],
                       "episodes": stats["episodes"]}, version, "eval")
        return report


class _StateHandler(web.RequestHandler):
    def initialize(self, plugin: NexusPlugin) -> None:
        self.plugin = plugin

    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(self.plugin.status(), default=str))


_prometheus_registered: list[PrometheusCollector] = []


def _register_prometheus(plugin: NexusPlugin) -> None:
    """One collector per scheduler process, pointing at the newest plugin."""
    import prometheus_client

    if _prometheus_registered:
        _prometheus_registered[0].plugin = plugin
        return
    collector = PrometheusCollector(plugin)
    prometheus_client.REGISTRY.register(collector)
    _prometheus_registered.append(collector)


dashboard.register()  # at import (preload), before the scheduler builds its dashboard


def dask_setup(scheduler) -> None:
    """Entry point of ``dask scheduler --preload nexus.control.plugin``."""
    scheduler.add_plugin(NexusPlugin(ServiceConfig.load()))
