"""Inference-engine pool and routing: which engines exist, which tenant each one serves.

Every engine holds every tenant's current head (heads are small; the backbone is the big, shared
part), so routing a tenant is a table entry and re-routing it is free. Rules:

* **Sync before join**: a new engine (scale-up or the replacement of a lost one) is started, receives
  every tenant's current weights and every pinned evaluation version, and only then serves. While it
  syncs it already receives new weights; an update that was dispatched before it existed is caught up
  afterwards (:meth:`EnginePool.on_published`; engines ignore versions older than the one they hold).
* **Drain before removal**: a removed engine first leaves the routing table (callers that still hold
  its route are refused with ``Draining`` and ask again), then finishes what it accepted, then stops.
  No request is lost or answered twice.
* **Serialized**: scale operations and replacements hold one lock; a second ``scale`` waits its turn.
* **Rollback**: a scale-up that fails part way stops the engines it added; the pool is as before.

The pool is a plain asyncio object; the work on workers goes through :class:`EngineOps`
(implemented over Dask in :mod:`nexus.control.supervisor`), so it is unit-tested without a cluster.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from nexus.control.health import HealthManager, RoleState
from nexus.errors import SpecError, Unavailable
from nexus.messages import EngineEndpoint, TenantSetup

logger = logging.getLogger("nexus.engines")

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

    def view(self, tenants: list[str]) -> dict[str, Any]:
        return {"slot": self.slot, "engine": self.endpoint.engine, "address": self.endpoint.address,
                "worker": self.worker, "state": str(self.state), "tenants": tenants}


@dataclass(frozen=True)
class PoolPolicy:
    engines: int = 1  # target pool size
    drain_timeout_s: float = 120.0
    route_wait_s: float = 300.0  # how long a caller waits for a serving engine

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError("an inference pool needs at least one engine")


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


class EnginePool:
    def __init__(self, ops: EngineOps, tenants: Callable[[], list[TenantSetup]], policy: PoolPolicy | None = None,
                 health: HealthManager | None = None) -> None:
        self.ops = ops
        self.policy = policy or PoolPolicy()
        self.target = self.policy.engines
        self.health = health or HealthManager()
        self._tenants = tenants
        self.members: dict[int, EngineMember] = {}
        self.routes: dict[str, int] = {}  # tenant -> slot
        self.pins: Counter[tuple[str, int]] = Counter()
        self._pin_dirs: dict[tuple[str, int], str] = {}
        self._epochs: Counter[int] = Counter()
        self._last_worker: dict[int, str] = {}
        self._retry_at: dict[int, float] = {}  # slot -> earliest next start after a failed one
        self._waiting_since: dict[int, float] = {}  # slot -> when it began waiting for a worker
        self._failures: Counter[int] = Counter()
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self.operations: list[dict[str, Any]] = []  # scale history (status, benchmark)

    # -- views ------------------------------------------------------------------------------------
    def serving(self) -> list[EngineMember]:
        return [m for _, m in sorted(self.members.items()) if m.state == MemberState.SERVING]

    def push_targets(self) -> list[EngineEndpoint]:
        """Engines that must receive a new version: serving ones and those still syncing."""
        return [m.endpoint for _, m in sorted(self.members.items())
                if m.state in (MemberState.SYNCING, MemberState.SERVING)]

    def view(self) -> dict[str, Any]:
        by_slot: dict[int, list[str]] = {}
        for tenant, slot in sorted(self.routes.items()):
            by_slot.setdefault(slot, []).append(tenant)
        return {"target": self.target, "busy": self._lock.locked(),
                "engines": [m.view(by_slot.get(s, [])) for s, m in sorted(self.members.items())],
                "routes": {t: self.members[s].endpoint.engine for t, s in sorted(self.routes.items())
                           if s in self.members},
                "pins": sorted(f"{t}@{v}" for (t, v), c in self.pins.items() if c > 0),
                "operations": self.operations[-20:]}

    def member_of(self, engine: str) -> EngineMember | None:
        return next((m for m in self.members.values() if m.endpoint.engine == engine), None)

    # -- routing -------------------------------------------------------------------------------------
    def route(self, tenant: str) -> EngineEndpoint | None:
        """The engine serving ``tenant`` (assigned to the least loaded serving engine if it has none)."""
        slot = self.routes.get(tenant)
        m = self.members.get(slot) if slot is not None else None
        if m is None or m.state != MemberState.SERVING:
            serving = self.serving()
            if not serving:
                return None
            load = Counter(self.routes.values())
            m = min(serving, key=lambda x: (load[x.slot], x.slot))
            self.routes[tenant] = m.slot
        return m.endpoint

    async def wait_route(self, tenant: str, stale: str | None = None, error: str | None = None,
                         timeout: float | None = None) -> EngineEndpoint:
        """A serving engine for ``tenant``; ``stale`` names an engine the caller could not use."""
        if stale is not None and error:
            m = self.member_of(stale)
            if m is not None:
                self.health.error(m.role, error)
        deadline = time.monotonic() + (self.policy.route_wait_s if timeout is None else timeout)
        waited_on_stale = False
        while True:
            ep = self.route(tenant)
            if ep is not None and (ep.engine != stale or waited_on_stale):
                return ep
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(f"no inference engine serves tenant {tenant!r} after "
                                  f"{self.policy.route_wait_s if timeout is None else timeout:g} s")
            # the caller failed on the engine we would route to: give the health manager a moment to see why
            waited_on_stale = ep is not None
            await self._wait_change(min(left, 1.0))

    async def _wait_change(self, timeout: float) -> None:
        ev = self._changed
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except TimeoutError:
            pass

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _rebalance(self) -> None:
        """Spread tenants over serving engines: each serves within one tenant of the others."""
        serving = {m.slot for m in self.serving()}
        names = [t.name for t in self._tenants()]
        self.routes = {t: s for t, s in self.routes.items() if t in names}
        if not serving:
            return
        for t in names:
            if self.routes.get(t) not in serving:
                self.route(t)
        while True:
            load = {s: [t for t, x in sorted(self.routes.items()) if x == s] for s in sorted(serving)}
            hi = max(load, key=lambda s: (len(load[s]), s))
            lo = min(load, key=lambda s: (len(load[s]), s))
            if len(load[hi]) - len(load[lo]) <= 1:
                return
            self.routes[load[hi][-1]] = lo

    # -- membership (serialized) ---------------------------------------------------------------------
    async def scale(self, n: int) -> dict[str, Any]:
        """Grow or shrink the pool to ``n`` engines; waits for any other scale operation first."""
        if n < 1:
            raise SpecError(f"an inference pool needs at least one engine, got {n}")
        async with self._lock:
            before = sorted(self.members)
            t0 = time.time()
            if n > len(self.members):
                new = [s for s in range(n + len(self.members)) if s not in self.members][: n - len(self.members)]
                added: list[EngineMember] = []
                try:
                    for slot in new:
                        self.health.register(f"engine/{slot}", "engine")
                        added.append(await self._start(slot))
                except Exception as e:
                    for m in added:
                        await self._discard(m)
                    for slot in new:
                        if slot not in self.members:
                            self.health.remove(f"engine/{slot}")
                    self.operations.append({"t": t0, "op": f"scale {len(before)}->{n}", "ok": False,
                                            "error": str(e), "s": time.time() - t0})
                    raise Unavailable(f"scaling the inference pool to {n} failed after {len(added)} of "
                                      f"{len(new)} new engines ({e}); rolled back to {len(before)}") from e
                for m in added:
                    self._serve(m)
            else:
                for slot in sorted(self.members, reverse=True)[: len(self.members) - n]:
                    await self._remove(slot)
            self.target = n
            self.operations.append({"t": t0, "op": f"scale {len(before)}->{n}", "ok": True, "s": time.time() - t0})
            return self.view()

    async def ensure(self) -> list[str]:
        """Start or replace engines until ``target`` serve (the supervisor's reconcile); returns errors."""
        errors: list[str] = []
        async with self._lock:
            for slot in range(self.target):
                m = self.members.get(slot)
                if m is not None and m.state != MemberState.FAILED:
                    continue
                now = time.monotonic()
                if now < self._retry_at.get(slot, 0.0):
                    continue
                role = f"engine/{slot}"
                h = self.health.register(role, "engine")
                if m is not None:  # a lost engine: its replacement takes the same slot
                    del self.members[slot]
                load = Counter(x.endpoint.address for x in self.members.values())
                waited = now - self._waiting_since.setdefault(slot, now)
                address = self.ops.place(self._last_worker.get(slot), dict(load), waited)
                if address is None:
                    continue  # no worker for it yet: wait, spending no restart
                if h.state == RoleState.FAILED and not self.health.begin_restart(role):
                    continue  # restart budget spent: the slot stays failed
                try:
                    self._serve(await self._start(slot, address))
                    self._waiting_since.pop(slot, None)
                    self._failures[slot] = 0
                except Exception as e:
                    self.health.fail(role, f"start failed: {e}")
                    self._failures[slot] += 1  # back off: 2, 4, ... 30 s between attempts
                    self._retry_at[slot] = time.monotonic() + min(30.0, 2.0 ** self._failures[slot])
                    errors.append(f"{role}: {e}")
                    logger.warning("could not start %s: %s", role, e)
        return errors

    async def _start(self, slot: int, address: str | None = None) -> EngineMember:
        if address is None:  # a scale-up: place it now (on the least loaded worker) or fail
            load = Counter(m.endpoint.address for m in self.members.values())
            address = self.ops.place(None, dict(load), float("inf"))
            if address is None:
                raise Unavailable("no worker can host another inference engine")
        self._epochs[slot] += 1
        ep, worker = await self.ops.start(slot, self._epochs[slot], address)
        m = EngineMember(slot=slot, epoch=self._epochs[slot], endpoint=ep, worker=worker)
        self.members[slot] = m  # receives new versions from now on
        self._last_worker[slot] = worker
        self.health.register(m.role, "engine", ep.address, worker)
        try:
            await self.ops.sync(ep, self._tenants(), self._pin_list())
        except BaseException:
            await self._discard(m)
            raise
        return m

    def _serve(self, m: EngineMember) -> None:
        m.state = MemberState.SERVING
        self.health.ready(m.role, m.endpoint.address, m.worker, reason="synced, serving")
        self._rebalance()
        self._notify()

    async def _remove(self, slot: int) -> None:
        m = self.members[slot]
        if m.state != MemberState.FAILED:
            m.state = MemberState.DRAINING
            self._rebalance()  # its tenants move to the others before it stops taking requests
            self._notify()
            try:
                await self.ops.drain(m.endpoint, self.policy.drain_timeout_s)
            except Exception as e:
                logger.warning("draining %s: %s", m.endpoint.engine, e)
        await self._discard(m)
        self.health.remove(m.role)

    async def _discard(self, m: EngineMember) -> None:
        if self.members.get(m.slot) is m:
            del self.members[m.slot]
        try:
            await self.ops.stop(m.endpoint)
        except Exception as e:
            logger.info("stopping %s: %s", m.endpoint.engine, e)
        self._rebalance()
        self._notify()

    def member_lost(self, address: str) -> list[EngineMember]:
        """The worker at ``address`` is gone: its engines fail and their tenants move to the others."""
        lost = [m for m in self.members.values() if m.endpoint.address == address and m.state != MemberState.FAILED]
        for m in lost:
            m.state = MemberState.FAILED
            self.health.fail(m.role, "worker lost")
        if lost:
            self._rebalance()
            self._notify()
        return lost

    # -- tenants, pins, versions -------------------------------------------------------------------------
    async def add_tenant(self, setup: TenantSetup) -> None:
        """Give a new tenant's head to every live engine and route it."""
        await self._each(lambda ep: self.ops.sync(ep, [setup], []), "register " + setup.name)
        self.route(setup.name)
        self._notify()

    async def remove_tenant(self, tenant: str) -> None:
        self.routes.pop(tenant, None)
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
        late = [m.endpoint for m in self.members.values()
                if m.state in (MemberState.SYNCING, MemberState.SERVING) and m.endpoint.engine not in pushed_to]
        for ep in late:
            try:
                await self.ops.sync(ep, [setup], [])
            except Exception as e:
                logger.warning("catch-up of %s on %s: %s", setup.name, ep.engine, e)

    def _pin_list(self) -> list[Pin]:
        return [(t, v, self._pin_dirs[(t, v)], c) for (t, v), c in sorted(self.pins.items()) if c > 0]

    async def _each(self, fn, what: str, strict: bool = False) -> None:
        """Run ``fn`` on every live engine; an engine that fails it is reported (and, when ``strict``, the
        error is raised once all were tried)."""
        targets = [m for m in self.members.values() if m.state in (MemberState.SYNCING, MemberState.SERVING)]
        results = await asyncio.gather(*(fn(m.endpoint) for m in targets), return_exceptions=True)
        errors = []
        for m, r in zip(targets, results, strict=True):
            if isinstance(r, BaseException):
                self.health.error(m.role, f"{what}: {r}")
                errors.append(r)
        if strict and errors and len(errors) == len(targets):
            raise errors[0]
