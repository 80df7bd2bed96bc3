"""Health manager: the state of every role of the service, from heartbeats and error reports.

Roles and their names:

=============  ==================  ===========================================================
kind           role name           evidence of life
=============  ==================  ===========================================================
``actor``      ``actor/<rank>``    heartbeats of the worker hosting the rank
``engine``     ``engine/<slot>``   heartbeats of the worker hosting the engine
``tracker``    ``tracker``         heartbeats of the worker hosting the MLflow tracker
``simulator``  ``sim/<worker>``    heartbeats of a ``SIM`` worker (hosts rollout producers)
``rollout``    ``producer/<job>``  progress of a job's rollout producers (requests, batches)
``dataset``    ``producer/<job>``  progress of an SFT job's dataset producer (batches)
=============  ==================  ===========================================================

States: ``starting`` (placed, not yet serving) → ``healthy`` → ``suspect`` (no heartbeat for
``suspect_after_s``) → ``failed`` (no heartbeat for ``fail_after_s``, its worker left the cluster,
or a fatal error report) → ``restarting`` (the supervisor rebuilds it in place; it is ``healthy``
again only once it has re-synced) → ``healthy``. Producers have no heartbeat of their own: one
without progress for ``producer_stall_s`` is ``suspect``; a failed attempt makes it ``restarting``
until the re-run succeeds. Each role may restart ``restart_budget`` times within
``budget_window_s``; past that it stays ``failed`` and the service reports that it needs a
global restart. A simulator whose worker left the cluster for good (not restarted by its nanny within
``fail_after_s``) is retired while other simulators serve: workers may join and leave. These timeouts
and budgets are :class:`nexus.config.service.HealthSettings` (``[health]``).

A plain object (no Dask, no I/O, the clock is injectable): unit-tested without a cluster.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from nexus.config.service import HealthSettings


class RoleState(StrEnum):
    STARTING = "starting"
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    FAILED = "failed"
    RESTARTING = "restarting"


HEARTBEAT_KINDS = frozenset({"actor", "engine", "tracker", "simulator"})
PRODUCER_KINDS = frozenset({"rollout", "dataset"})


@dataclass
class RoleHealth:
    role: str
    kind: str
    state: RoleState = RoleState.STARTING
    address: str | None = None
    worker: str | None = None
    epoch: int = 0  # incarnation: +1 at every (re)start that completes
    since: float = 0.0  # when the current state began
    last_seen: float | None = None
    restarts: int = 0
    restart_times: list[float] = field(default_factory=list)
    errors: int = 0
    last_error: str | None = None
    reason: str = ""
    budget_spent: bool = False
    detail: dict[str, Any] = field(default_factory=dict)

    def view(self, now: float, settings: HealthSettings) -> dict[str, Any]:
        recent = [t for t in self.restart_times if now - t <= settings.budget_window_s]
        return {"role": self.role, "kind": self.kind, "state": str(self.state), "worker": self.worker,
                "address": self.address, "epoch": self.epoch, "restarts": self.restarts,
                "restart_budget_left": max(0, settings.restart_budget - len(recent)),
                "since_heartbeat_s": None if self.last_seen is None else round(now - self.last_seen, 3),
                "in_state_s": round(now - self.since, 3), "reason": self.reason, "errors": self.errors,
                "last_error": self.last_error, "budget_spent": self.budget_spent, "detail": dict(self.detail)}


Listener = Callable[[RoleHealth, RoleState, RoleState], None]


class HealthManager:
    def __init__(self, settings: HealthSettings | None = None, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings or HealthSettings()
        self.clock = clock
        self.roles: dict[str, RoleHealth] = {}
        self.history: deque[dict[str, Any]] = deque(maxlen=1000)  # every state change, oldest first
        self.listeners: list[Listener] = []

    # -- registry ----------------------------------------------------------------------------
    def register(self, role: str, kind: str, address: str | None = None, worker: str | None = None,
                 state: RoleState = RoleState.STARTING) -> RoleHealth:
        """Add a role (idempotent: an existing role keeps its state and counters)."""
        if role in self.roles:
            r = self.roles[role]
            if address is not None:
                r.address, r.worker = address, worker
            return r
        now = self.clock()
        r = RoleHealth(role=role, kind=kind, state=state, address=address, worker=worker, since=now,
                       last_seen=now if kind in PRODUCER_KINDS else None)
        self.roles[role] = r
        self.history.append({"t": now, "role": role, "from": None, "to": str(state), "reason": "registered"})
        return r

    def remove(self, role: str) -> None:
        self.roles.pop(role, None)

    def get(self, role: str) -> RoleHealth | None:
        return self.roles.get(role)

    def state(self, role: str) -> RoleState | None:
        r = self.roles.get(role)
        return None if r is None else r.state

    def on_role(self, address: str) -> list[RoleHealth]:
        return [r for r in self.roles.values() if r.address == address]

    # -- evidence ------------------------------------------------------------------------------
    def heartbeat(self, address: str, detail: dict[str, dict[str, Any]] | None = None,
                  now: float | None = None) -> None:
        """A heartbeat of the worker at ``address``: every role placed there is alive.

        A role that is ``restarting`` stays so until :meth:`ready` (it must re-sync first); a ``failed``
        role stays failed until the supervisor restarts it."""
        now = self.clock() if now is None else now
        for r in self.on_role(address):
            if r.kind not in HEARTBEAT_KINDS:
                continue
            r.last_seen = now
            if detail and r.role in detail:
                r.detail = detail[r.role]
            if r.state in (RoleState.STARTING, RoleState.SUSPECT) and r.epoch > 0:
                self._set(r, RoleState.HEALTHY, "heartbeat", now)

    def progress(self, role: str, now: float | None = None, **detail: Any) -> None:
        """A producer made progress (a request answered, a batch produced)."""
        r = self.roles.get(role)
        if r is None:
            return
        now = self.clock() if now is None else now
        r.last_seen = now
        r.detail.update(detail)
        if r.state in (RoleState.STARTING, RoleState.SUSPECT, RoleState.RESTARTING):
            self._set(r, RoleState.HEALTHY, "progress", now)

    def error(self, role: str, message: str, fatal: bool = False, restarting: bool = False) -> None:
        """An error report. ``fatal``: the role is gone (failed); ``restarting``: a producer re-runs its work."""
        r = self.roles.get(role)
        if r is None:
            return
        r.errors += 1
        r.last_error = message[:500]
        if fatal and r.state != RoleState.FAILED:
            self._set(r, RoleState.FAILED, f"error: {message[:200]}")
        elif restarting:
            r.restarts += 1
            r.restart_times.append(self.clock())
            self._set(r, RoleState.RESTARTING, f"re-run after error: {message[:200]}")

    def worker_lost(self, address: str) -> list[RoleHealth]:
        """The worker at ``address`` left the cluster: every role on it has failed."""
        lost = []
        for r in self.on_role(address):
            if r.state != RoleState.FAILED:
                self._set(r, RoleState.FAILED, "worker lost")
            r.address = None
            lost.append(r)
        return lost

    def tick(self, now: float | None = None) -> list[RoleHealth]:
        """Apply the timeouts; returns the roles that failed by timeout in this tick."""
        now = self.clock() if now is None else now
        p = self.settings
        failed = []
        for r in list(self.roles.values()):
            if r.last_seen is None:
                continue
            age = now - r.last_seen
            if r.kind in HEARTBEAT_KINDS and r.state in (RoleState.HEALTHY, RoleState.SUSPECT):
                if age > p.fail_after_s:
                    self._set(r, RoleState.FAILED, f"no heartbeat for {age:.1f} s", now)
                    failed.append(r)
                elif age > p.suspect_after_s and r.state == RoleState.HEALTHY:
                    self._set(r, RoleState.SUSPECT, f"no heartbeat for {age:.1f} s", now)
            elif r.kind in PRODUCER_KINDS and r.state == RoleState.HEALTHY and age > p.producer_stall_s:
                self._set(r, RoleState.SUSPECT, f"no progress for {age:.1f} s", now)
        return failed

    # -- restarts ------------------------------------------------------------------------------
    def begin_restart(self, role: str, reason: str = "in-place restart", now: float | None = None) -> bool:
        """Take one restart from the role's budget; False (and the role stays failed) when it is spent."""
        r, p = self.roles[role], self.settings
        now = self.clock() if now is None else now
        r.restart_times = [t for t in r.restart_times if now - t <= p.budget_window_s]
        if len(r.restart_times) >= p.restart_budget:
            if not r.budget_spent:
                r.budget_spent = True
                r.reason = f"restart budget spent ({p.restart_budget} in {p.budget_window_s:g} s)"
                self.history.append({"t": now, "role": role, "from": str(r.state), "to": str(r.state),
                                     "reason": r.reason})
            return False
        r.restart_times.append(now)
        r.restarts += 1
        self._set(r, RoleState.RESTARTING, reason, now)
        return True

    def fail(self, role: str, reason: str) -> None:
        r = self.roles.get(role)
        if r is not None and r.state != RoleState.FAILED:
            self._set(r, RoleState.FAILED, reason)

    def ready(self, role: str, address: str | None, worker: str | None, now: float | None = None,
              reason: str = "serving") -> None:
        """A (re)start completed: the role serves from ``address`` with a new epoch."""
        r = self.roles[role]
        now = self.clock() if now is None else now
        r.address, r.worker, r.last_seen = address, worker, now
        r.epoch += 1
        r.budget_spent = False
        self._set(r, RoleState.HEALTHY, reason, now)

    def retire_departed(self, kind: str, after_s: float, now: float | None = None) -> list[str]:
        """Drop the roles of ``kind`` whose worker left the cluster ``after_s`` ago and never came back, while
        another role of the kind serves: a host removed or scaled down (workers join and leave on a service over
        several hosts), not a fault left to repair. A nanny-restarted worker rejoins under its name long before.
        Returns the roles dropped (each with a history entry)."""
        now = self.clock() if now is None else now
        mine = [r for r in self.roles.values() if r.kind == kind]
        if not any(r.state == RoleState.HEALTHY for r in mine):
            return []  # the last ones stay failed: the service has no capacity of this kind
        gone = [r for r in mine if r.state == RoleState.FAILED and r.address is None and now - r.since > after_s]
        for r in gone:
            del self.roles[r.role]
            self.history.append({"t": now, "role": r.role, "from": str(r.state), "to": "retired",
                                 "reason": f"its worker {r.worker} left the cluster {now - r.since:.0f} s ago"})
        return [r.role for r in gone]

    # -- views -----------------------------------------------------------------------------------
    def needs_global_restart(self) -> list[str]:
        return sorted(r.role for r in self.roles.values() if r.budget_spent and r.state == RoleState.FAILED)

    def views(self, now: float | None = None) -> list[dict[str, Any]]:
        now = self.clock() if now is None else now
        return [r.view(now, self.settings) for r in sorted(self.roles.values(), key=lambda r: r.role)]

    def _set(self, r: RoleHealth, state: RoleState, reason: str, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        old = r.state
        r.state, r.reason, r.since = state, reason, now
        self.history.append({"t": now, "role": r.role, "from": str(old), "to": str(state), "reason": reason})
        for fn in self.listeners:
            fn(r, old, state)


def prometheus_families(roles: Iterable[dict[str, Any]]):
    """Role health as Prometheus metrics (one-hot state gauge, restarts, heartbeat age)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    state = GaugeMetricFamily("nexus_role_state", "1 for the role's current state", labels=["role", "kind", "state"])
    restarts = CounterMetricFamily("nexus_role_restarts", "In-place restarts of a role", labels=["role", "kind"])
    age = GaugeMetricFamily("nexus_role_seconds_since_heartbeat", "Seconds since the role's last heartbeat",
                            labels=["role"])
    for r in roles:
        for s in RoleState:
            state.add_metric([r["role"], r["kind"], str(s)], 1.0 if r["state"] == s else 0.0)
        restarts.add_metric([r["role"], r["kind"]], r["restarts"])
        if r["since_heartbeat_s"] is not None:
            age.add_metric([r["role"]], r["since_heartbeat_s"])
    return [state, restarts, age]
