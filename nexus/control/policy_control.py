"""The scheduling policy of a running service: its view and switching it while the service is idle.

Benchmarks compare policies on one cluster (``nexus_set_policy``). A switch validates the policy, builds
the new effective config (:meth:`nexus.config.ServiceConfig.with_policy`: the one mapping from policy
knobs to settings) and hands the policy to every part that holds one of its knobs (``apply``): the
training queue's order, the dispatcher's concurrency, admission (shared or isolated), the flows'
evaluation fan-out and weight-sync rule, the admission defaults of tenants created later, the settings
engines, the actor group and the tracker start with, and the serving engines' T and B.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from nexus.errors import Conflict, SpecError
from nexus.scheduling import SchedulerPolicy

if TYPE_CHECKING:
    from nexus.config import ServiceConfig
    from nexus.control.dispatcher import Dispatcher
    from nexus.control.engines import EnginePool
    from nexus.control.jobs import JobManager
    from nexus.control.queues import TrainingQueue


class PolicyPart(Protocol):
    def apply(self, policy: SchedulerPolicy) -> None: ...


class PolicyControl:
    def __init__(self, config: ServiceConfig, parts: Sequence[PolicyPart], pool: EnginePool, jobs: JobManager,
                 queue: TrainingQueue, dispatcher: Dispatcher) -> None:
        self.config = config  # the effective one: status shows it
        self.parts = list(parts)
        self.pool = pool  # applied last: its T and B go to the serving engines
        self.jobs = jobs
        self.queue = queue
        self.dispatcher = dispatcher

    def view(self) -> dict[str, Any]:
        return {"policy": self.config.scheduler_policy.model_dump() if self.config.scheduler_policy else None,
                "admission": self.jobs.admission.view(), "queue_order": self.queue.order}

    async def switch(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Switch to the policy ``raw`` (``SchedulerPolicy`` fields) while no job runs; returns the new view."""
        try:
            policy = SchedulerPolicy.model_validate(raw)
        except Exception as e:
            raise SpecError(f"invalid scheduler policy: {e}") from None
        busy = self.jobs.busy()
        if busy or len(self.queue) or self.dispatcher.running:
            raise Conflict(f"the policy changes only while no job runs (running or queued: {busy})")
        self.config = self.config.with_policy(policy)
        for part in self.parts:
            part.apply(policy)
        await self.pool.apply(policy)
        return self.view()
