"""Jobs: ids, states, the runner around each flow, cancellation, and the job's durable records.

States: ``queued`` → ``running`` → ``done`` | ``failed`` | ``cancelled`` (the record and its allowed
moves: :mod:`nexus.control.jobs.state`). A job id is ``<tenant>-<kind>-<n>``; ``n`` continues past
every job number found in the tenants' output dirs, so ids stay unique across service restarts. When
a job starts, a record ``jobs/<id>.json`` marks it running in the tenant's output dir (so a crashed
service can mark it failed later); at its end the actor checkpoints (training jobs), rewrites the
record and appends it to the manifest, and the MLflow run is closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from nexus.config.service import ServiceLimits
from nexus.config.validation import check_eval_version, validate_job
from nexus.control import tasks
from nexus.control.dispatch.admission import Admission
from nexus.control.jobs import flows
from nexus.control.jobs.external_rollouts import ExternalRollouts
from nexus.control.jobs.state import JobState, JobStatus
from nexus.control.tenants.registry import TenantPhase, TenantRegistry, TenantState
from nexus.errors import Conflict, NotFound, quote

if TYPE_CHECKING:
    from nexus.config.service import ServiceConfig
    from nexus.control.health.actor_group import ActorGroup
    from nexus.control.monitoring.state import MonitoringState
    from nexus.control.monitoring.tracking_link import TrackerLink
    from nexus.control.runtime import DaskRuntime

logger = logging.getLogger("nexus.jobs")


class JobTable:
    """Job ids that never repeat: one counter, moved past every job number seen in output dirs."""

    def __init__(self) -> None:
        self._seq = 0

    def observe(self, seq: int) -> None:
        self._seq = max(self._seq, int(seq))

    def next_id(self, tenant: str, kind: str) -> str:
        self._seq += 1
        return f"{tenant}-{kind}-{self._seq}"


class JobManager:
    def __init__(self, registry: TenantRegistry, ctx: flows.FlowContext, actors: ActorGroup, runtime: DaskRuntime,
                 tracker: TrackerLink, monitoring: MonitoringState, event: Callable[[str, dict], None],
                 flush_signals: Callable[[], Awaitable[None]],
                 limits_for: Callable[[str], ServiceLimits] = lambda _t: ServiceLimits(),
                 isolated: bool = False) -> None:
        self.registry = registry
        self.admission = Admission(isolated)
        self.limits_for = limits_for
        self.ctx = ctx
        self.actors = actors
        self.runtime = runtime
        self.tracker = tracker
        self.monitoring = monitoring
        self.ids = JobTable()
        self.jobs: dict[str, JobState] = {}
        self.external = ExternalRollouts()  # RL jobs trained on uploaded episodes
        self._event = event
        self._flush_signals = flush_signals
        ctx.log = self.log

    # -- API ------------------------------------------------------------------------------------------
    def get(self, job_id: str) -> JobState:
        if job_id not in self.jobs:
            raise NotFound(f"unknown job {quote(job_id)}")
        return self.jobs[job_id]

    def view(self, js: JobState) -> dict[str, Any]:
        return {**js.view(), "metered_s": self.monitoring.job_metering(js.job_id)}

    def submit(self, tenant: str, raw: dict[str, Any]) -> str:
        t = self.registry.get(tenant)
        if t.phase != TenantPhase.READY:
            raise Conflict(f"tenant {tenant!r} is {t.phase}; submit again once it is ready")
        limits = self.limits_for(tenant)
        # queued or running: a cancelled evaluation's quota is back when cancel returns, while its record is still
        # being written (``finished``)
        active_evals = sum(1 for j in t.jobs if j in self.jobs and self.jobs[j].spec.kind == "eval"
                           and not self.jobs[j].terminal)
        job = validate_job(t.spec, raw, limits, active_evals)
        if job.kind in ("sft", "rl") and t.training_job is not None:
            raise Conflict(f"tenant {tenant!r} already runs training job {t.training_job!r}")
        if job.kind == "eval":
            check_eval_version(tenant, job.version, t.version, limits)
        js = JobState(job_id=self.ids.next_id(tenant, job.kind), tenant=tenant, spec=job)
        self.jobs[js.job_id] = js
        t.jobs.append(js.job_id)
        if job.kind in ("sft", "rl"):
            t.training_job = js.job_id
        js.task = asyncio.get_running_loop().create_task(self._run(js, t))
        return js.job_id

    async def wait(self, job_id: str, timeout: float | None = None) -> dict[str, Any]:
        js = self.get(job_id)
        try:
            await asyncio.wait_for(js.finished.wait(), timeout)
        except TimeoutError:
            pass
        return self.view(js)

    async def cancel(self, job_id: str, timeout: float = 120.0, recorded: bool = False) -> dict[str, Any]:
        """Stop a job and free everything it holds (admission slots, queued items, SIM slots, pins, its
        tenant's training-job lock); an update already running on the actor finishes, unread; its rollouts
        stop before their next step. Returns once the job is ``cancelled`` (its record, checkpoint and MLflow
        run are written after, in the background: ``wait`` sees them done; ``recorded``: wait for them too)."""
        js = self.get(job_id)
        if not js.terminal and js.task is not None:
            js.cancel_requested = True
            js.task.cancel()
            self.runtime.spawn(self.runtime.broadcast("SIM", "nexus_sim_stop", job=job_id))
            try:
                await asyncio.wait_for((js.finished if recorded else js.ended).wait(), timeout)
            except TimeoutError:
                pass
        return self.view(js)

    async def settle(self, timeout: float) -> list[str]:
        """Wait (up to ``timeout``) for the jobs that ended but still record themselves (checkpoint, job record, their
        MLflow run's end), so a closing service leaves no ended job's run RUNNING; returns those still recording."""
        ending = [j for j in self.jobs.values() if j.terminal and not j.finished.is_set()]
        if ending:
            await asyncio.wait([asyncio.ensure_future(j.finished.wait()) for j in ending], timeout=timeout)
        return [j.job_id for j in ending if not j.finished.is_set()]

    def of_tenant(self, tenant: str) -> list[JobState]:
        return [j for j in self.jobs.values() if j.tenant == tenant]

    def busy(self) -> list[str]:
        """Jobs not finished yet (queued or running)."""
        return [j.job_id for j in self.jobs.values() if not j.finished.is_set()]

    def apply(self, config: ServiceConfig) -> None:
        """A new scheduler for jobs that start from now on: shared or isolated admission, the evaluation
        fan-out, the RL batches' split and the data path's settings (the weight-sync rule among them)."""
        self.admission.apply(config)
        self.ctx.follow(config.dispatch)
        self.ctx.datapath = config.datapath

    def log(self, js: JobState, metrics: dict[str, Any], step: int, kind: str) -> None:
        """One history row (``nexus.wire.history``: kind train / rollout / eval / queue, a monotonic step per kind)."""
        js.progress.update({k: v for k, v in metrics.items() if not (kind == "rollout" and k == "version")})
        js.history.append({"kind": kind, "step": step, **metrics})
        self.tracker.log_metrics(js.job_id, metrics, step, kind)

    # -- runner -----------------------------------------------------------------------------------------
    async def _run(self, js: JobState, t: TenantState) -> None:
        try:  # isolated mode: "queued" until no other tenant's job runs
            await self.admission.acquire(js.job_id, js.tenant)
        except asyncio.CancelledError:
            js.t_end = time.time()
            js.move(*((JobStatus.CANCELLED, "cancelled by request") if js.cancel_requested else (
                JobStatus.FAILED, "cancelled: the service is closing")))
            if t.training_job == js.job_id:
                t.training_job = None
            js.ended.set()
            js.finished.set()
            self._event("job", {"job": js.job_id, "state": str(js.state), "error": js.error})
            if not js.cancel_requested:
                raise
            return
        try:
            await self._run_admitted(js, t)
        finally:
            self.admission.release(js.tenant)

    async def _run_admitted(self, js: JobState, t: TenantState) -> None:
        js.move(JobStatus.RUNNING)
        js.t_start = time.time()
        self._event("job", {"job": js.job_id, "state": "running"})
        try:
            await self._record_start(js, t)
            params = {**t.spec.model_dump(), **{f"job.{k}": v for k, v in js.spec.model_dump().items()}}
            # an evaluation is a nested run under the tenant's latest training job whose run exists already
            # (one submitted just before may start after it: the tracker would not know its run yet)
            parent = next((j for j in reversed(t.jobs) if j in self.jobs and self.jobs[j].spec.kind != "eval"
                           and self.jobs[j].run_started), None)
            self.tracker.start_run(js.job_id, js.tenant, js.spec.kind, params,
                                   parent if js.spec.kind == "eval" else None, js.t_submit)
            js.run_started = True
            runner = {"sft": flows.run_sft, "rl": flows.run_rl, "eval": flows.run_eval}[js.spec.kind]
            if js.spec.kind == "rl" and js.spec.rollouts == "external":
                runner = self.external.run
            js.result = await runner(self.ctx, js, t)
            js.move(JobStatus.DONE)
        except asyncio.CancelledError:
            if not js.cancel_requested:
                js.move(JobStatus.FAILED, "cancelled: the service is closing")
                raise
            js.move(JobStatus.CANCELLED, "cancelled by request")
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        except Exception as e:
            js.move(JobStatus.FAILED, f"{type(e).__name__}: {e}")
            logger.error("job %s failed:\n%s", js.job_id, traceback.format_exc())
        finally:
            js.t_end = time.time()
            if t.training_job == js.job_id:
                t.training_job = None
            js.ended.set()
            try:
                await self._finish(js, t)
            finally:
                js.finished.set()
                self._event("job", {"job": js.job_id, "state": str(js.state), "error": js.error})

    async def _record_start(self, js: JobState, t: TenantState) -> None:
        try:
            await self.runtime.io("write_job_record", output_dir=t.output_dir, record=_plain(js.record()))
        except Exception as e:  # the job runs anyway; only crash bookkeeping would miss it
            logger.warning("could not record the start of %s: %s", js.job_id, e)

    async def _finish(self, js: JobState, t: TenantState) -> None:
        """Checkpoint (training jobs), record the job in its output dir, close the MLflow run."""
        artifacts: list[str] = []
        if self.registry.find(js.tenant) is t and t.phase != TenantPhase.DELETING:
            record = _plain(js.record() | {"history": js.history})
            train = js.spec.kind in ("sft", "rl")
            # MLflow gets the weights of the version this job evaluated or produced
            version = (js.result or js.progress).get("version")
            try:
                engines = tuple(self.ctx.pool.push_targets()) if train else ()  # lazy sync's last version
                out = await self.actors.run(tasks.FINISH_JOB,
                                            lambda r: (js.tenant, t.output_dir, record, train, version, engines),
                                            key=f"nexus-finish-{js.job_id}", retry_lost=True, timeout=600)
                artifacts = list(out["artifacts"])
            except Exception as e:
                logger.error("could not record job %s: %s", js.job_id, e)
        if js.result and js.result.get("report_path"):
            artifacts.append(js.result["report_path"])
        try:
            await asyncio.wait_for(self._flush_signals(), 10)
        except Exception as e:
            logger.info("flushing engine signals: %s", e)
        self.tracker.end_run(js.job_id, str(js.state), artifacts, _plain(js.result or {}), _plain(js.history),
                             self.monitoring.job_metering(js.job_id), js.t_end)


def _plain(x: Any) -> Any:
    """msgpack-able copy (numpy scalars and arrays become Python numbers and lists)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, str | int | float | bool) or x is None:
        return x
    return str(x)
