"""The inference pool's members and what the pool asks of the cluster for them.

:class:`EngineMember` is one engine of the pool (its slot, incarnation, endpoint and state);
:class:`EngineOps` is the pool's whole interface to the cluster (place, start, sync, drain, stop, …), and
:class:`DaskEngineOps` implements it over Dask: engines live in workers' Nexus plugins and are driven by
``nexus_engine_ctl`` calls. The pool itself (:mod:`nexus.control.health.engine_pool`) is a plain asyncio object,
unit-tested with an in-process stand-in for these ops.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from distributed.protocol import to_serialize

from nexus.control import tasks
from nexus.wire.messages import EngineEndpoint, TenantSetup

if TYPE_CHECKING:
    from nexus.config.service import ServiceConfig
    from nexus.control.runtime import DaskRuntime

START_TIMEOUT_S = 180.0  # a role's start on its worker (engines here; the actor group and tracker: supervisor)
PLACEMENT_GRACE_S = 30.0  # how long a role waits for its own (restarting) or a free worker

Pin = tuple[str, int, str, int]  # tenant, version, output dir, count


class MemberState(StrEnum):
    SYNCING = "syncing"
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"


@dataclass
class EngineMember:
    slot: int
    epoch: int
    endpoint: EngineEndpoint
    worker: str
    state: MemberState = MemberState.SYNCING

    @property
    def role(self) -> str:
        return f"engine/{self.slot}"

    @property
    def live(self) -> bool:
        """Receives new versions, pins and tenants (syncing or serving)."""
        return self.state in (MemberState.SYNCING, MemberState.SERVING)

    def view(self, tenants: list[str], tenants_total: int) -> dict[str, Any]:
        return {"slot": self.slot, "engine": self.endpoint.engine, "address": self.endpoint.address,
                "worker": self.worker, "state": str(self.state), "tenants": tenants, "tenants_total": tenants_total}


class EngineOps(Protocol):
    """What the pool asks of the cluster."""

    def place(self, prefer_worker: str | None, load: dict[str, int], waited_s: float) -> str | None:
        """The worker address for a new engine, or None to wait (no worker yet, or the preferred one is
        restarting). ``load``: engines per address; ``waited_s``: how long this slot has waited."""
        ...

    async def start(self, slot: int, epoch: int, address: str) -> tuple[EngineEndpoint, str]: ...

    async def sync(self, ep: EngineEndpoint, tenants: list[TenantSetup], pins: list[Pin]) -> None: ...

    async def drain(self, ep: EngineEndpoint, timeout: float) -> None: ...

    async def stop(self, ep: EngineEndpoint) -> None: ...

    async def unregister(self, ep: EngineEndpoint, tenant: str) -> None: ...

    async def pin(self, ep: EngineEndpoint, tenant: str, version: int, output_dir: str) -> None: ...

    async def unpin(self, ep: EngineEndpoint, tenant: str, version: int) -> None: ...

    async def set_batching(self, ep: EngineEndpoint, max_wait_s: float, max_batch: int) -> Any: ...


class DaskEngineOps:
    """:class:`EngineOps` over the cluster: engines live in workers' Nexus plugins."""

    def __init__(self, runtime: DaskRuntime, config: ServiceConfig) -> None:
        self.runtime = runtime
        self.config = config  # an engine starts with the settings of the moment (a new T, B: apply)

    def apply(self, config: ServiceConfig) -> None:
        """A new scheduler: engines started from now on get its settings (T, B, …)."""
        self.config = config

    def place(self, prefer_worker: str | None, load: dict[str, int], waited_s: float) -> str | None:
        """In place first: a lost engine waits (up to ``PLACEMENT_GRACE_S``) for its restarted worker of
        the same name; a new one prefers a worker without an engine, and waits as long for one to join."""
        workers = self.runtime.workers("INFER")
        if not workers:
            return None
        same = [w for w in workers if w.name == prefer_worker]
        if same:
            return same[0].address
        # a worker holds as many engines as its INFER count (a worker holding several devices), else one
        best = min(workers, key=lambda w: (load.get(w.address, 0) / max(w.resources.get("INFER", 1), 1), w.name))
        full = load.get(best.address, 0) >= max(int(best.resources.get("INFER", 1)), 1)
        if waited_s < PLACEMENT_GRACE_S and (prefer_worker is not None or full):
            return None
        return best.address

    async def start(self, slot: int, epoch: int, address: str) -> tuple[EngineEndpoint, str]:
        engine_id = f"engine-{slot}.{epoch}"
        info = await asyncio.wait_for(self.runtime.run(tasks.START_ENGINE, engine_id, self.config,
                                                       key=f"nexus-engine-start-{engine_id}", workers=[address]),
                                      START_TIMEOUT_S)
        return EngineEndpoint(engine_id, info["address"]), info["worker"]

    async def _ctl(self, ep: EngineEndpoint, action: str, timeout: float = 300.0, **msg: Any) -> Any:
        return await self.runtime.call(ep.address, "nexus_engine_ctl", timeout=timeout, engine=ep.engine,
                                       action=action, **msg)

    async def sync(self, ep: EngineEndpoint, tenants: list[TenantSetup], pins: list[Pin]) -> None:
        await self._ctl(ep, "sync", tenants=to_serialize(list(tenants)), pins=[list(p) for p in pins])

    async def drain(self, ep: EngineEndpoint, timeout: float) -> None:
        await self._ctl(ep, "drain", timeout=timeout + 30, drain_timeout=timeout)

    async def stop(self, ep: EngineEndpoint) -> None:
        await self._ctl(ep, "stop", timeout=30)

    async def unregister(self, ep: EngineEndpoint, tenant: str) -> None:
        await self._ctl(ep, "unregister", tenant=tenant)

    async def pin(self, ep: EngineEndpoint, tenant: str, version: int, output_dir: str) -> None:
        await self._ctl(ep, "pin", tenant=tenant, version=version, output_dir=output_dir)

    async def unpin(self, ep: EngineEndpoint, tenant: str, version: int) -> None:
        await self._ctl(ep, "unpin", tenant=tenant, version=version)

    async def stats(self, ep: EngineEndpoint) -> dict[str, Any]:
        return await self._ctl(ep, "stats", timeout=30)

    async def flush_signals(self, ep: EngineEndpoint) -> None:
        await self._ctl(ep, "flush_signals", timeout=30)

    async def set_batching(self, ep: EngineEndpoint, max_wait_s: float, max_batch: int) -> dict[str, Any]:
        """T and B for a serving engine (engines started later read theirs from the config)."""
        return await self._ctl(ep, "batching", timeout=30, max_wait_s=max_wait_s, max_batch=max_batch)
