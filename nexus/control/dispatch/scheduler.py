"""The scheduler of a running service: its view and switching it while the service is idle.

Benchmarks compare schedulers on one cluster (``nexus_set_scheduler``). A switch validates the scheduler (a
named overlay of the service's settings, :class:`nexus.config.service.Scheduler`), builds the new effective config
(:meth:`nexus.config.service.ServiceConfig.with_scheduler`: its settings over the running ones) and hands that config to
every part that holds one of the settings (``apply``): the training queue's order, the dispatcher's concurrency,
admission (shared or isolated), the flows' evaluation fan-out, split and weight-sync rule, the admission defaults
of tenants created later, the settings engines, the actor group and the tracker start with, the engines'
routing, and the serving engines' T and B.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from nexus.config.service import Scheduler
from nexus.errors import Conflict, SpecError

if TYPE_CHECKING:
    from nexus.config.service import ServiceConfig
    from nexus.control.dispatch.dispatcher import Dispatcher
    from nexus.control.dispatch.training_queue import TrainingQueue
    from nexus.control.health.engine_pool import EnginePool
    from nexus.control.jobs.manager import JobManager


class SchedulerPart(Protocol):
    def apply(self, config: ServiceConfig) -> None: ...


class SchedulerControl:
    def __init__(self, config: ServiceConfig, parts: Sequence[SchedulerPart], pool: EnginePool, jobs: JobManager,
                 queue: TrainingQueue, dispatcher: Dispatcher) -> None:
        self.config = config  # the effective one: status shows it
        self.parts = list(parts)
        self.pool = pool  # applied last: its T and B go to the serving engines
        self.jobs = jobs
        self.queue = queue
        self.dispatcher = dispatcher

    def view(self) -> dict[str, Any]:
        c = self.config
        return {"scheduler": {"name": c.scheduler,
                              "infer_max_wait_s": c.infer_max_wait_s, "infer_max_batch": c.infer_max_batch,
                              "routing": c.routing, "dispatch": c.dispatch.model_dump(),
                              "datapath": {"sync_mode": c.datapath.sync_mode, "sync_every": c.datapath.sync_every},
                              "limits": {"default_max_inflight": c.limits.default_max_inflight,
                                         "default_max_staleness": c.limits.default_max_staleness}},
                "admission": self.jobs.admission.view(), "queue_order": self.queue.order}

    async def switch(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Switch to the scheduler ``raw`` (``Scheduler`` fields: name, description, settings) while no job runs;
        returns the new view. An invalid scheduler is refused whole: nothing of it applies."""
        try:
            sched = Scheduler.model_validate(raw).checked("invalid scheduler")
        except SpecError:
            raise
        except Exception as e:
            raise SpecError(f"invalid scheduler: {e}") from None
        busy = self.jobs.busy()
        if busy or len(self.queue) or self.dispatcher.running:
            raise Conflict(f"the scheduler changes only while no job runs (running or queued: {busy})")
        config = self.config.with_scheduler(sched)
        self.config = config
        for part in self.parts:
            part.apply(config)
        await self.pool.apply(config)
        return self.view()
