"""Inference-engine pool: its engines, which tenant each one serves, and what every engine holds.

Every engine holds every tenant's current head and every pinned evaluation version. The pool has
three parts:

* **membership** (:mod:`nexus.control.health.membership`): sync before join, drain before removal, rollback of
  a partly failed scale-up, in-place replacement of a lost engine;
* **routing** (:mod:`nexus.control.dispatch.routing`): a tenant's engine is a table entry, rebalanced after every
  membership change; a removed engine leaves the table before it drains (callers that still hold its
  route are refused with ``Draining`` and ask again), so no request is lost or answered twice;
* **contents** (here): a new tenant, a pin, an unpin reach every live engine; an update dispatched
  before an engine existed is caught up afterwards (:meth:`EnginePool.on_published`; engines ignore
  versions older than the one they hold); a policy's T and B reach every serving engine.

**Serialized**: scale operations and replacements hold the pool's one lock; a second ``scale`` waits
its turn. The pool is a plain asyncio object; the work on workers goes through :class:`EngineOps`
(implemented over Dask in :mod:`nexus.control.health.engine_ops`), so it is unit-tested without a cluster.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nexus.control.dispatch.routing import Routing
from nexus.control.health.engine_ops import EngineMember, EngineOps, MemberState, Pin
from nexus.control.health.manager import HealthManager
from nexus.control.health.membership import Membership
from nexus.errors import SpecError
from nexus.wire.messages import EngineEndpoint, TenantSetup

if TYPE_CHECKING:
    from nexus.config.service import ServiceConfig

logger = logging.getLogger("nexus.engines")

__all__ = ["EngineMember", "EngineOps", "EnginePool", "MemberState", "Pin", "PoolPolicy"]


@dataclass(frozen=True)
class PoolPolicy:
    """The pool's own timeouts (its size is ``ServiceConfig.inference_engines``, then :meth:`EnginePool.scale`)."""

    drain_timeout_s: float = 120.0
    route_wait_s: float = 300.0  # how long a caller waits for a serving engine


class EnginePool:
    def __init__(self, ops: EngineOps, tenants: Callable[[], list[TenantSetup]], engines: int = 1,
                 policy: PoolPolicy | None = None, health: HealthManager | None = None,
                 batching: tuple[float, int] | None = None) -> None:
        if engines < 1:
            raise ValueError("an inference pool needs at least one engine")
        self.ops = ops
        self.policy = policy or PoolPolicy()
        self.health = health or HealthManager()
        self.batching = batching  # the serving engines' (T, B): ServiceConfig.infer_max_wait_s, infer_max_batch
        self._tenants = tenants
        self.pins: Counter[tuple[str, int]] = Counter()
        self._pin_dirs: dict[tuple[str, int], str] = {}
        self.routing = Routing(self.policy.route_wait_s)
        self.membership = Membership(ops, self.health, engines, self.policy.drain_timeout_s,
                                     lambda: (self._tenants(), self._pin_list()), self._changed)
        self.members = self.membership.members  # slot -> engine
        self._lock = asyncio.Lock()

    @property
    def target(self) -> int:
        """Engines the pool should have (``ServiceConfig.inference_engines``, then :meth:`scale`)."""
        return self.membership.target

    # -- views ------------------------------------------------------------------------------------
    def serving(self) -> list[EngineMember]:
        return [m for _, m in sorted(self.members.items()) if m.state == MemberState.SERVING]

    def push_targets(self) -> list[EngineEndpoint]:
        """Engines that must receive a new version: serving ones and those still syncing."""
        return [m.endpoint for _, m in sorted(self.members.items()) if m.live]

    def view(self, tenants: Collection[str] | None = None) -> dict[str, Any]:
        """The pool; ``tenants``: list only these tenants' routes (a status page stays the same size however
        many tenants there are; each engine still counts all of its own)."""
        by_slot = self.routing.by_slot()
        shown = None if tenants is None else set(tenants)
        routes = sorted(self.routing.routes.items()) if shown is None else sorted(
            (t, s) for t in shown if (s := self.routing.routes.get(t)) is not None)
        return {"target": self.target, "busy": self._lock.locked(),
                "engines": [m.view([t for t in by_slot.get(s, []) if shown is None or t in shown],
                                   len(by_slot.get(s, []))) for s, m in sorted(self.members.items())],
                "routes": {t: self.members[s].endpoint.engine for t, s in routes if s in self.members},
                "pins": sorted(f"{t}@{v}" for (t, v), c in self.pins.items() if c > 0),
                "operations": self.membership.operations[-20:]}

    def member_of(self, engine: str) -> EngineMember | None:
        return next((m for m in self.members.values() if m.endpoint.engine == engine), None)

    # -- routing -------------------------------------------------------------------------------------
    def route(self, tenant: str) -> EngineEndpoint | None:
        """The engine serving ``tenant`` (assigned to the least loaded serving engine if it has none)."""
        slot = self.routing.slot_of(tenant, [m.slot for m in self.serving()])
        return None if slot is None else self.members[slot].endpoint

    async def wait_route(self, tenant: str, stale: str | None = None, error: str | None = None,
                         timeout: float | None = None) -> EngineEndpoint:
        """A serving engine for ``tenant``; ``stale`` names an engine the caller could not use."""
        if stale is not None and error:
            m = self.member_of(stale)
            if m is not None:
                self.health.error(m.role, error)
        return await self.routing.wait(tenant, lambda: self.route(tenant), stale, timeout)

    def _changed(self) -> None:
        """Membership changed: spread tenants over the serving engines, wake callers waiting for a route."""
        self.routing.rebalance([t.name for t in self._tenants()], [m.slot for m in self.serving()])
        self.routing.changed()

    # -- membership (serialized) ---------------------------------------------------------------------
    async def scale(self, n: int) -> dict[str, Any]:
        """Grow or shrink the pool to ``n`` engines; waits for any other scale operation first."""
        if n < 1:
            raise SpecError(f"an inference pool needs at least one engine, got {n}")
        async with self._lock:
            await self.membership.scale(n)
            return self.view()

    async def ensure(self) -> list[str]:
        """Start or replace engines until ``target`` serve (the supervisor's reconcile); returns errors."""
        async with self._lock:
            return await self.membership.ensure()

    def member_lost(self, address: str) -> list[EngineMember]:
        """The worker at ``address`` is gone: its engines fail and their tenants move to the others."""
        return self.membership.lost(address)

    # -- tenants, pins, versions, batching -----------------------------------------------------------------
    async def add_tenant(self, setup: TenantSetup) -> None:
        """Give a new tenant's head to every live engine and route it."""
        await self._each(lambda ep: self.ops.sync(ep, [setup], []), "register " + setup.name)
        self.route(setup.name)
        self.routing.changed()

    async def remove_tenant(self, tenant: str) -> None:
        self.routing.drop(tenant)
        for key in [k for k in self.pins if k[0] == tenant]:
            del self.pins[key]
        await self._each(lambda ep: self.ops.unregister(ep, tenant), "unregister " + tenant)

    async def pin(self, tenant: str, version: int, output_dir: str) -> None:
        """Keep ``version`` of a tenant on every engine, present and future, until :meth:`unpin`."""
        self.pins[(tenant, version)] += 1
        self._pin_dirs[(tenant, version)] = output_dir
        await self._each(lambda ep: self.ops.pin(ep, tenant, version, output_dir), f"pin {tenant}@{version}",
                         strict=True)

    async def unpin(self, tenant: str, version: int) -> None:
        key = (tenant, version)
        if self.pins.get(key, 0) <= 0:
            return
        self.pins[key] -= 1
        if self.pins[key] == 0:
            del self.pins[key]
        await self._each(lambda ep: self.ops.unpin(ep, tenant, version), f"unpin {tenant}@{version}")

    async def on_published(self, setup: TenantSetup, pushed_to: tuple[str, ...]) -> None:
        """After an update: engines that did not get the new version (they joined later) catch up."""
        for ep in [m.endpoint for m in self.members.values() if m.live and m.endpoint.engine not in pushed_to]:
            try:
                await self.ops.sync(ep, [setup], [])
            except Exception as e:
                logger.warning("catch-up of %s on %s: %s", setup.name, ep.engine, e)

    async def apply(self, config: ServiceConfig) -> None:
        """A new scheduler: its T and B go to every serving engine (the ops start later ones with them); an
        engine that keeps its old values is logged (it gets the new ones when it restarts)."""
        batching = (config.infer_max_wait_s, config.infer_max_batch)
        if batching == self.batching:
            return
        self.batching = batching
        pushed = await asyncio.gather(*(self.ops.set_batching(m.endpoint, *batching) for m in self.serving()),
                                      return_exceptions=True)
        for e in pushed:
            if isinstance(e, BaseException):
                logger.warning("scheduler %r: an engine kept its old T/B: %s", config.scheduler, e)

    def _pin_list(self) -> list[Pin]:
        return [(t, v, self._pin_dirs[(t, v)], c) for (t, v), c in sorted(self.pins.items()) if c > 0]

    async def _each(self, fn, what: str, strict: bool = False) -> None:
        """Run ``fn`` on every live engine; an engine that fails it is reported (and, when ``strict``, the
        error is raised once all were tried)."""
        targets = [m for m in self.members.values() if m.live]
        results = await asyncio.gather(*(fn(m.endpoint) for m in targets), return_exceptions=True)
        errors = []
        for m, r in zip(targets, results, strict=True):
            if isinstance(r, BaseException):
                self.health.error(m.role, f"{what}: {r}")
                errors.append(r)
        if strict and errors and len(errors) == len(targets):
            raise errors[0]
