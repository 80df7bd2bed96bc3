"""Idle tenants' actor slots go to disk, so a thousand tenants share one actor: a slot (head, value head,
LoRA adapter, optimizer state in its DeepSpeed engine) of a tenant with nothing running, nothing queued and no
activity for ``ServiceConfig.offload_idle_s`` is offloaded — its latest checkpoint (always its current
version) is its state on disk, and the rank frees it. The next item of that tenant (an update, a low-level
op) restores it from there on every rank, transparently: never a 404, never a lost step.

Offloading runs on every actor rank as one task while the dispatcher holds new items back, so the ranks see
offloads and updates in the same order (restoring a slot builds a DeepSpeed engine: collective on N ranks).
The engines keep serving the tenant's head meanwhile: only the actor's copy is offloaded.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING

from nexus.control import tasks
from nexus.control.tenants.registry import TenantPhase

if TYPE_CHECKING:
    from nexus.control.dispatch.dispatcher import Dispatcher
    from nexus.control.dispatch.training_queue import TrainingQueue
    from nexus.control.health.actor_group import ActorGroup
    from nexus.control.jobs.manager import JobManager
    from nexus.control.tenants.registry import TenantRegistry

logger = logging.getLogger("nexus.offload")

BATCH = 64  # tenants offloaded per task (the dispatcher waits that long at most)


class SlotOffload:
    def __init__(self, idle_s: float, registry: TenantRegistry, jobs: JobManager, queue: TrainingQueue,
                 dispatcher: Dispatcher, actors: ActorGroup) -> None:
        self.idle_s = idle_s
        self.registry, self.jobs, self.queue, self.dispatcher, self.actors = registry, jobs, queue, dispatcher, actors
        self.offloaded: set[str] = set()
        self.last_active: dict[str, float] = {}
        self.busy = False
        self._seq = itertools.count()

    def touch(self, tenant: str) -> None:
        """The tenant is active now (an item of it runs): the actor restores its slot if it was offloaded."""
        self.last_active[tenant] = time.time()
        self.offloaded.discard(tenant)

    def forget(self, tenant: str) -> None:
        self.last_active.pop(tenant, None)
        self.offloaded.discard(tenant)

    def candidates(self, now: float, idle_s: float | None = None) -> list[str]:
        """Ready tenants with no job unfinished, nothing in the training queue, idle for ``idle_s``."""
        idle_s = self.idle_s if idle_s is None else idle_s
        out = []
        for t in self.registry:
            if t.phase != TenantPhase.READY or t.name in self.offloaded or t.training_job is not None:
                continue
            since = self.last_active.setdefault(t.name, now)
            c = self.queue.counters.get(t.name)
            if now - since < idle_s or (c is not None and c.inflight):
                continue
            if any(j in self.jobs.jobs and not self.jobs.jobs[j].finished.is_set() for j in t.jobs):
                continue
            out.append(t.name)
        return out

    async def now(self, idle_s: float = 0.0, timeout: float = 600.0) -> dict[str, int]:
        """Offload every tenant idle for ``idle_s`` now, whatever ``offload_idle_s`` says (``nexus_offload``:
        operators, benchmarks); returns how many slots are offloaded."""
        deadline = time.monotonic() + timeout
        batches = -(-len(self.candidates(time.time(), idle_s)) // BATCH)
        while batches > 0 and time.monotonic() < deadline:  # a slot kept (gradients pending) is not retried here
            if await self.tick(idle_s):
                batches -= 1
            else:
                await asyncio.sleep(0.2)  # the actor group is busy: try again
        return {"offloaded": len(self.offloaded), "tenants": len(self.registry)}

    async def tick(self, idle_s: float | None = None) -> bool:
        """Offload a batch of idle tenants when the actor group is idle (called every second); True if it ran."""
        if ((self.idle_s <= 0 and idle_s is None) or self.busy or not self.actors.ready or self.dispatcher.running
                or len(self.queue)):
            return False
        names = self.candidates(time.time(), idle_s)[:BATCH]
        if not names:
            return False
        setups = [self.registry.get(n).setup() for n in names]
        self.busy = True  # the dispatcher holds new items until every rank has offloaded
        try:
            key = f"nexus-offload-{next(self._seq)}"
            res = await self.actors.run(tasks.OFFLOAD_SLOTS, lambda r: (setups,), key=key, timeout=300)
            self.offloaded.update(n for n in res["offloaded"] if self.registry.find(n) is not None)
            for name in res["kept"]:  # gradients waiting for an optim_step: try again after another idle time
                self.last_active[name] = time.time()
        except Exception as e:  # a rank lost meanwhile: the rebuilt group holds every slot again
            logger.warning("offloading %d idle slots: %s", len(names), e)
        finally:
            self.busy = False
            self.dispatcher.pump()
        return True

    def resident(self, names: list[str]) -> list[str]:
        """The tenants among ``names`` whose slot is on the actor (not offloaded)."""
        return [n for n in names if n not in self.offloaded]
