"""Job admission: when a submitted job may start.

Shared (the default): at once — tenants' jobs run side by side on the shared services. Isolated (the
paper's baseline, ``dispatch.isolated``): a job waits ``queued`` until no other tenant's job
runs *and* no other tenant's job submitted before it still waits, so tenants take the whole service one
after another in submission order (FIFO); a tenant's own jobs (an evaluation beside its training job)
may overlap. Either way the job then runs through the same flows, queues and services.

A plain asyncio object (no Dask, no I/O), unit-tested without a cluster.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nexus.config.service import ServiceConfig


class Admission:
    def __init__(self, isolated: bool = False) -> None:
        self.isolated = isolated
        self._waiting: list[tuple[str, str]] = []  # (job id, tenant) in submission order
        self._running: Counter[str] = Counter()  # tenant -> admitted jobs not yet released
        self._changed = asyncio.Event()

    def _may_start(self, job_id: str, tenant: str) -> bool:
        if not self.isolated:
            return True
        if any(n > 0 for t, n in self._running.items() if t != tenant):
            return False
        for j, t in self._waiting:  # an earlier job of another tenant goes first
            if j == job_id:
                return True
            if t != tenant:
                return False
        return True

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def acquire(self, job_id: str, tenant: str) -> None:
        """Wait until ``job_id`` may start; cancelling the caller takes it out of the line."""
        self._waiting.append((job_id, tenant))
        try:
            while not self._may_start(job_id, tenant):
                await self._changed.wait()
        finally:
            self._waiting.remove((job_id, tenant))
            self._notify()  # a job leaving the line (started or cancelled) may unblock the next one
        self._running[tenant] += 1

    def release(self, tenant: str) -> None:
        self._running[tenant] -= 1
        if self._running[tenant] <= 0:
            del self._running[tenant]
        self._notify()

    def apply(self, config: ServiceConfig) -> None:
        """A new scheduler: shared or isolated (its ``dispatch.isolated``) from now on."""
        self.isolated = config.dispatch.isolated
        self._notify()

    def view(self) -> dict[str, object]:
        return {"isolated": self.isolated, "waiting": [j for j, _ in self._waiting],
                "running_tenants": sorted(self._running)}
