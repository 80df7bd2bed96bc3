"""Accounting of the service's devices: the workers allocated to each service now, and busy time, device
time and utilization per service over a window (from the spans in :class:`MonitoringState`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nexus.deploy.processes import DEVICES_RESOURCE

if TYPE_CHECKING:
    from nexus.control.health.actor_group import ActorGroup
    from nexus.control.health.engine_pool import EnginePool
    from nexus.control.monitoring.state import MonitoringState


class ServiceAccounting:
    def __init__(self, scheduler, actors: ActorGroup, pool: EnginePool, monitoring: MonitoringState) -> None:
        self.scheduler = scheduler
        self.actors = actors
        self.pool = pool
        self.monitoring = monitoring

    def _count(self, name: str) -> int:
        """The devices a worker holds: its ``DEVICES`` resource (``nexus.wire.devices``; 1 when not said), each
        a slot of its service."""
        ws = next((w for w in self.scheduler.workers.values() if str(w.name) == name), None)
        return int(ws.resources.get(DEVICES_RESOURCE, 1)) if ws is not None else 1

    def _expand(self, name: str) -> list[str]:
        """A worker's slots: itself, or ``<name>#<i>`` for each device it holds."""
        n = self._count(name)
        return [name] if n <= 1 else [f"{name}#{i}" for i in range(n)]

    def slots(self) -> dict[str, list[str]]:
        """Slots allocated to each service now (actor ranks, serving engines, SIM workers; devices where a worker
        holds several)."""
        names = {addr: str(ws.name) for addr, ws in self.scheduler.workers.items()}
        engines = set()
        for m in self.pool.serving():
            name = names.get(m.worker, str(m.worker))
            engines.add(name if self._count(name) <= 1 else f"{name}#{m.slot}")
        return {"actor": [s for w in self.actors.workers for s in self._expand(str(w))],
                "inference": sorted(engines),
                "simulator": sorted(s for ws in self.scheduler.workers.values() if "SIM" in ws.resources
                                    for s in self._expand(str(ws.name)))}

    def worker_aliases(self) -> dict[str, str]:
        """Worker address -> name: signals name their worker by address, slots by name."""
        return {addr: str(ws.name) for addr, ws in self.scheduler.workers.items()}

    def window(self, t0: float | None = None, t1: float | None = None) -> dict[str, Any]:
        """Busy time, device time and utilization per service over ``[t0, t1]`` (default: the service's life)."""
        return self.monitoring.accounting(self.slots(), t0, t1, self.worker_aliases())

    def totals(self) -> dict[str, Any]:
        """Over the service's whole life (the status view; windows: :meth:`window`)."""
        return self.monitoring.totals(self.slots(), self.worker_aliases())
