"""Low-level ops grouped in MLflow runs: one run per client connection, i.e. per (tenant, session).

Tinker-style ops (``forward_backward``, ``optim_step``, ``save_weights``) belong to no job, yet their
metrics belong in MLflow. Each ``Nexus`` client sends a session id with its ops (``nexus.spec.check_session``;
calls without one share the tenant's ``default`` session). The first op of a session that succeeds opens a
run (kind ``ops``, named ``<tenant>-ops-<session[:8]>``, tags ``nexus.tenant`` / ``nexus.session``); each
op logs its metrics as a ``train`` history row, so the tracker names them as it names a job's
(``train/loss``, ``train/grad_norm``, ``system/weight_sync_s``: ``nexus.tracking.tracker.metric_name``),
at step = the op's sequence number in its run (monotonic in every series); ``save_weights`` also logs
``train/published_version`` and the run's artifact is the weights file of the last version it published.

The run ends FINISHED — start = its first op's arrival, end = its last op's completion — once its session
has been idle ``idle_s`` with no op in flight (``close_idle``, from the Master's sampling loop), when its
tenant is deleted (``close_tenant``) or when the service closes (``close_all``). A later op of the same
session opens a new run (a new tracker key). A restarted tracker loses nothing: the calls go through the
``TrackerLink``, which resends them and reopens the runs it knows. Plain bookkeeping, no I/O: every
tracker call is queued and never waits, so this runs on the scheduler's event loop.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

KIND = "ops"
VERBS = ("forward_backward", "optim_step", "save_weights")  # always counted; the other verbs once used


class Tracking(Protocol):  # what OpRuns needs of nexus.control.monitoring.tracking_link.TrackerLink
    def start_run(self, job_id: str, tenant: str, kind: str, params: dict[str, Any], parent_job: str | None = None,
                  start_time: float | None = None, run_name: str | None = None,
                  tags: dict[str, str] | None = None) -> None: ...

    def log_metrics(self, job_id: str, metrics: dict[str, Any], step: int, kind: str = "train") -> None: ...

    def end_run(self, job_id: str, status: str, artifacts: list[str], result: dict[str, Any],
                history: list[dict[str, Any]] | None = None, metering: dict[str, float] | None = None,
                end_time: float | None = None) -> None: ...


def run_name(tenant: str, session: str) -> str:
    return f"{tenant}-{KIND}-{session[:8]}"


@dataclass
class OpRun:
    """An open MLflow run of one session."""

    key: str  # the tracker's run key (unique per run: the nexus.job tag)
    t_first: float
    t_last: float
    seq: int = 0  # ops recorded: the step of the latest
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(VERBS, 0))
    published: int | None = None  # the last version save_weights published
    weights: str | None = None  # its weights file


@dataclass
class Session:
    tenant: str
    session: str
    inflight: int = 0
    run: OpRun | None = None
    closed: bool = False  # its tenant was deleted / the service closes: late results are not recorded


class OpRuns:
    def __init__(self, tracker: Tracking, idle_s: float, clock: Callable[[], float] = time.time,
                 new_key: Callable[[str, str], str] | None = None) -> None:
        self.tracker = tracker
        self.idle_s = float(idle_s)
        self.clock = clock
        self._new_key = new_key or (lambda tenant, session: f"{run_name(tenant, session)}-{uuid.uuid4().hex[:8]}")
        self.sessions: dict[tuple[str, str], Session] = {}
        self.ended: list[str] = []  # keys of the runs ended so far (views, tests)

    # -- one op -------------------------------------------------------------------------------------
    def begin(self, tenant: str, session: str) -> tuple[Session, float]:
        """An op of ``session`` arrived: while it is in flight its session does not count as idle."""
        s = self.sessions.get((tenant, session))
        if s is None:
            s = self.sessions[(tenant, session)] = Session(tenant, session)
        s.inflight += 1
        return s, self.clock()

    def finish(self, token: tuple[Session, float], verb: str, result: dict[str, Any] | None,
               params: Callable[[], dict[str, Any]], weights_of: Callable[[int], str] | None = None) -> None:
        """The op ended; ``result`` (``{"version", "metrics"}``) None when it failed (nothing is logged).
        ``params``: the run's parameters, asked for when this op opens the run."""
        s, t_arrived = token
        s.inflight -= 1
        if result is None or s.closed:
            return
        now = self.clock()
        run = s.run
        if run is None:
            run = s.run = OpRun(key=self._new_key(s.tenant, s.session), t_first=t_arrived, t_last=now)
            self.tracker.start_run(run.key, s.tenant, KIND, {**params(), "session": s.session}, None, t_arrived,
                                   run_name=run_name(s.tenant, s.session), tags={"nexus.session": s.session})
        run.seq += 1
        run.t_last = max(run.t_last, now)
        run.counts[verb] = run.counts.get(verb, 0) + 1
        metrics = {k: v for k, v in dict(result.get("metrics") or {}).items() if k != "version"}
        version = result.get("version")
        if verb == "save_weights" and isinstance(version, int):
            run.published = version
            metrics["published_version"] = version
            if weights_of is not None:
                run.weights = weights_of(version)
        self.tracker.log_metrics(run.key, metrics, run.seq, "train")

    # -- ending runs ----------------------------------------------------------------------------------
    def close_idle(self, now: float | None = None) -> list[str]:
        """End the runs of sessions idle ``idle_s`` (no op in flight); forget idle sessions without a run."""
        now = self.clock() if now is None else now
        ended = []
        for k, s in list(self.sessions.items()):
            if s.inflight > 0:
                continue
            if s.run is None:
                del self.sessions[k]
            elif now - s.run.t_last >= self.idle_s:
                ended.append(self._end(s, "idle"))
                del self.sessions[k]
        return ended

    def close_tenant(self, tenant: str) -> list[str]:
        """The tenant was deleted: end its sessions' runs now (an op still in flight is not recorded)."""
        return [key for k in list(self.sessions) if k[0] == tenant and (key := self._close(k, "tenant deleted"))]

    def close_all(self) -> list[str]:
        """The service closes: end every run now."""
        return [key for k in list(self.sessions) if (key := self._close(k, "service closing"))]

    def _close(self, k: tuple[str, str], reason: str) -> str | None:
        s = self.sessions.pop(k)
        s.closed = True
        return self._end(s, reason) if s.run is not None else None

    def _end(self, s: Session, reason: str) -> str:
        run = s.run
        assert run is not None
        s.run = None
        # the run's result.json: why it ended, how many ops of each verb
        result = {"session": s.session, "ended": reason, "ops": run.seq, **run.counts}
        if run.published is not None:
            result["version"] = run.published  # the tracker tags the run with it
        self.tracker.end_run(run.key, "done", [run.weights] if run.weights else [], result, None, None, run.t_last)
        self.ended.append(run.key)
        return run.key

    # -- views ----------------------------------------------------------------------------------------
    def view(self) -> list[dict[str, Any]]:
        return [{"tenant": s.tenant, "session": s.session, "inflight": s.inflight,
                 "run": None if s.run is None else s.run.key, "ops": 0 if s.run is None else s.run.seq,
                 "t_first": None if s.run is None else s.run.t_first,
                 "t_last": None if s.run is None else s.run.t_last}
                for s in self.sessions.values()]
