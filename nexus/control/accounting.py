"""Accounting of the service's devices: the workers allocated to each service now, and busy time, device
time and utilization per service over a window (from the spans in :class:`MonitoringState`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nexus.control.actors import ActorGroup
    from nexus.control.engines import EnginePool
    from nexus.control.monitoring import MonitoringState


class ServiceAccounting:
    def __init__(self, scheduler, actors: ActorGroup, pool: EnginePool, monitoring: MonitoringState) -> None:
        self.scheduler = scheduler
        self.actors = actors
        self.pool = pool
        self.monitoring = monitoring

    def slots(self) -> dict[str, list[str]]:
        """Workers allocated to each service now (actor ranks, serving engines' workers, SIM workers)."""
        names = {addr: str(ws.name) for addr, ws in self.scheduler.workers.items()}
        return {"actor": [str(w) for w in self.actors.workers],
                "inference": sorted({names.get(m.worker, str(m.worker)) for m in self.pool.serving()}),
                "simulator": sorted(str(ws.name) for ws in self.scheduler.workers.values() if "SIM" in ws.resources)}

    def worker_aliases(self) -> dict[str, str]:
        """Worker address -> name: signals name their worker by address, slots by name."""
        return {addr: str(ws.name) for addr, ws in self.scheduler.workers.items()}

    def window(self, t0: float | None = None, t1: float | None = None) -> dict[str, Any]:
        """Busy time, device time and utilization per service over ``[t0, t1]`` (default: the service's life)."""
        return self.monitoring.accounting(self.slots(), t0, t1, self.worker_aliases())

    def totals(self) -> dict[str, Any]:
        """Over the service's whole life (the status view; windows: :meth:`window`)."""
        return self.monitoring.totals(self.slots(), self.worker_aliases())
