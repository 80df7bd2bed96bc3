"""Fair share of the simulators between tenants: who runs the next rollout or evaluation task on a ``SIM`` slot.

Dask runs the tasks it is given in its own order, first come first served: one tenant's two 500-episode
evaluations, submitted first, held every SIM worker until they ended while another tenant's short RL job
waited. So the flows take a slot here before they hand a rollout task to Dask, and hand it back when the task
ends (or is cancelled): Dask never holds more rollout tasks than there are SIM slots, and the order is ours.

When a slot frees and several tenants wait, it goes to the tenant holding the fewest slots now (ties: the
longest waiting request first), so with N slots and k tenants each gets about N/k — max-min fair share. With the
scheduler's ``dispatch.sim_order = "critical"`` it goes to the tenant with the most simulator work left instead
(``remaining``, set by the control plane from its signals), then by that fair rule.
Evaluations run in tasks of at most ``simulators.task_episodes`` episodes (:mod:`nexus.control.jobs.flows`), so the
slots change hands between episodes: that is the preemption, at episode boundaries, without killing anything.

Capacity is read from the cluster at each decision (the sum of the SIM workers' ``SIM`` resource), and
waiters look again every second, so a joining or leaving SIM worker needs no hook. ``fair=False`` keeps
Dask's order (the baseline): every request is granted at once.

A plain asyncio object on the scheduler's loop (no I/O).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nexus.config.service import SimOrder
    from nexus.control.runtime import DaskRuntime

# a place (a simulator slot, a device) granted later than this after it was asked for had to be waited for
WAITED_S = 0.001


def ready_from(ready_at: float, asked: float, granted: float, freed_at: float = 0.0) -> float:
    """When a task could start on the devices' clock (wall clock; 0: not said): ``ready_at``, the end of the work
    that let it start, unless its place was waited for (asked at ``asked``, granted at ``granted``): then from when
    the place's last holder ended on the devices' clock (``freed_at``; its task came back to the scheduler a few
    host milliseconds later) or, when that is not known, from the grant."""
    if not ready_at or granted - asked <= WAITED_S:
        return ready_at
    return max(ready_at, freed_at) if freed_at else granted


@dataclass(order=True)
class _Waiter:
    seq: int
    tenant: str = field(compare=False)
    future: asyncio.Future = field(compare=False)  # its result: the freed place's ``Place.ended_at``


@dataclass
class Place:
    """A slot held by a rollout task: ``freed_at``, when its last holder's work ended on the devices' clock (0: not
    known, or not waited for); the holder sets ``ended_at`` likewise for the next one."""

    freed_at: float = 0.0
    ended_at: float = 0.0


class SimSlots:
    def __init__(self, capacity: Callable[[], int], fair: bool = True, recheck_s: float = 1.0) -> None:
        self.capacity, self.fair, self.recheck_s = capacity, fair, recheck_s
        self.order: SimOrder = "fair"  # dispatch.sim_order
        self.remaining: Callable[[str], float] = lambda tenant: 0.0  # a tenant's simulator work left (s)
        self.held: Counter[str] = Counter()
        self._waiting: list[_Waiter] = []
        self._seq = itertools.count()
        self.granted = 0
        self.waited_s = 0.0  # summed wait of granted requests

    @property
    def busy(self) -> int:
        return sum(self.held.values())

    def free(self) -> int:
        """Slots neither held nor waited for now."""
        return max(0, self.capacity() - self.busy - len(self._waiting))

    @asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[Place]:
        """Hold one SIM slot for ``tenant`` while the block runs (a rollout task)."""
        place = Place(freed_at=await self.acquire(tenant))
        try:
            yield place
        finally:
            self.release(tenant, place.ended_at)

    async def acquire(self, tenant: str) -> float:
        """Wait for a slot; returns the ``ended_at`` its last holder left (0: not known, or free at once)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if not self.fair:
            self._take(tenant)
            return 0.0
        w = _Waiter(next(self._seq), tenant, loop.create_future())
        self._waiting.append(w)
        try:
            while True:
                self._grant()
                if w.future.done():
                    break
                try:
                    await asyncio.wait_for(asyncio.shield(w.future), self.recheck_s)
                except TimeoutError:
                    continue
                break
        except BaseException:
            if w in self._waiting:
                self._waiting.remove(w)
            elif w.future.done() and not w.future.cancelled():  # granted while being cancelled: hand it back
                self.release(tenant, w.future.result())
            raise
        self.waited_s += loop.time() - t0
        return w.future.result()

    def release(self, tenant: str, ended_at: float = 0.0) -> None:
        """Hand a slot back; ``ended_at`` (the holder's end on the devices' clock) goes to the waiter it is granted
        to."""
        self.held[tenant] -= 1
        if self.held[tenant] <= 0:
            del self.held[tenant]
        self._grant(ended_at)

    def _take(self, tenant: str) -> None:
        self.held[tenant] += 1
        self.granted += 1

    def _grant(self, freed_at: float = 0.0) -> None:
        """Free slots to waiters: the tenant with the most work left first (``"critical"`` order), the tenant holding
        the fewest, then the longest waiting; the first one granted gets the slot just released and its holder's end
        (``freed_at``)."""
        free = self.capacity() - self.busy
        left = {w.tenant: self.remaining(w.tenant) for w in self._waiting} if self.order == "critical" else {}
        while free > 0 and self._waiting:
            w = min(self._waiting, key=lambda x: (-left.get(x.tenant, 0.0), self.held[x.tenant], x.seq))
            self._waiting.remove(w)
            self._take(w.tenant)
            w.future.set_result(freed_at)
            freed_at = 0.0
            free -= 1

    @classmethod
    def of_cluster(cls, runtime: DaskRuntime, fair: bool) -> SimSlots:
        """Slots of the cluster's SIM workers (their ``SIM`` resource, summed at each decision)."""
        return cls(lambda: int(sum(w.resources.get("SIM", 0) for w in runtime.workers("SIM"))), fair)

    def view(self) -> dict[str, Any]:
        waiting = Counter(w.tenant for w in self._waiting)
        return {"capacity": self.capacity(), "held": dict(self.held), "waiting": dict(waiting),
                "granted": self.granted, "fair": self.fair, "order": self.order}
