"""Scheduling decisions from the control signals (beyond the paper's fixed FIFO and routing).

* **Remaining work** (``queue_order = "critical"``): the training queue ranks an item by the work its
  tenant's running job has left — items left x the tenant's measured item time (the dispatcher's running
  mean) — after putting items that unblock a producer (RL) before filler (SFT).
* **Simulator work left** (``sim_order = "critical"``): a freed simulator place goes to the tenant whose running
  RL jobs have the most simulator seconds left (updates left x its metered simulator seconds per update).
* **Load routing** (``routing = "load"``): every ``period_s`` the tenants are re-assigned to the serving
  engines by their measured inference load over the last period (longest-processing-time first: the
  heaviest tenant to the least loaded engine), so no engine queues while another idles. The paper lists
  fixed routing as a limitation; a moved tenant's next rollout goes to its new engine (every engine holds
  every tenant's head, so a move costs nothing).

Plain asyncio-free objects on the scheduler's loop: :meth:`LoadRouting.tick` is called by the Master's
sampler once a second.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from nexus.control.jobs.state import JobStatus

if TYPE_CHECKING:
    from nexus.config.service import ServiceConfig
    from nexus.control.dispatch.dispatcher import Dispatcher
    from nexus.control.health.engine_pool import EnginePool
    from nexus.control.jobs.manager import JobManager
    from nexus.control.monitoring.state import MonitoringState


def remaining_items(jobs: JobManager, tenant: str) -> int:
    """Training items the tenant's running jobs still have to run (RL updates, SFT steps)."""
    left = 0
    for js in jobs.of_tenant(tenant):
        if js.state != JobStatus.RUNNING:
            continue
        total = getattr(js.spec, "updates", None) or getattr(js.spec, "steps", None) or 0
        done = js.progress.get("updates", js.progress.get("steps", 0)) or 0
        left += max(0, int(total) - int(done))
    return left


def remaining_sim_s(jobs: JobManager, metered: dict[str, dict[str, float]], tenant: str) -> float:
    """Simulator seconds the tenant's running RL jobs still need: each one's updates left x its metered simulator
    seconds per update so far (``MonitoringState.metered_jobs``; 1 s before its first update, so the job with the
    most updates left leads)."""
    total = 0.0
    for js in jobs.of_tenant(tenant):
        if js.state == JobStatus.RUNNING and js.spec.kind == "rl":
            done = int(js.progress.get("updates", 0) or 0)
            per = metered.get(js.job_id, {}).get("simulator", 0.0) / done if done else 1.0
            total += max(0, int(js.spec.updates) - done) * per
    return total


class LoadRouting:
    def __init__(self, pool: EnginePool, monitoring: MonitoringState, jobs: JobManager, dispatcher: Dispatcher,
                 routing: str = "static", period_s: float = 3.0) -> None:
        self.pool, self.monitoring, self.period_s = pool, monitoring, period_s
        self.enabled = routing == "load"  # the service's ``routing`` (its scheduler's); a switch changes it
        self.moves = 0
        self._last: dict[str, float] = {}
        self._t = 0.0
        dispatcher.queue.remaining = lambda t: remaining_items(jobs, t) * dispatcher.item_s.get(t, 1.0)
        if jobs.ctx.sim_slots is not None:  # the simulators' "critical" order
            jobs.ctx.sim_slots.remaining = lambda t: remaining_sim_s(jobs, monitoring.metered_jobs, t)

    def apply(self, config: ServiceConfig) -> None:
        """A new scheduler: load routing on or off (its ``routing``)."""
        self.enabled = config.routing == "load"

    def tick(self) -> None:
        now = time.monotonic()
        if not self.enabled or now - self._t < self.period_s:
            return
        self._t = now
        total = {t: v.get("inference", 0.0) for t, v in self.monitoring.metered.items()}
        load = {t: total[t] - self._last.get(t, 0.0) for t in total}
        self._last = total
        serving = [m.slot for m in self.pool.serving()]
        routes = self.pool.routing.routes
        busy = {t: x for t, x in load.items() if x > 0 and t in routes}
        if len(serving) < 2 or not busy:
            return
        assigned = {s: 0.0 for s in serving}
        plan: dict[str, int] = {}
        for t in sorted(busy, key=lambda t: (-busy[t], t)):  # heaviest first, each to the least loaded engine
            prefer = routes.get(t)
            s = min(serving, key=lambda s: (assigned[s], s != prefer, s))
            plan[t] = s
            assigned[s] += busy[t]
        before = {s: sum(x for t, x in busy.items() if routes.get(t) == s) for s in serving}
        if max(assigned.values()) < 0.9 * max(before.values()):  # move only for a real gain (no flapping)
            self.moves += sum(routes.get(t) != s for t, s in plan.items())
            routes.update(plan)
            self.pool.routing.changed()
