"""Routing of tenants to the inference pool's serving engines (by slot), and the wait for a route.

Every engine holds every tenant's current head (heads are small; the backbone is the big, shared part),
so routing a tenant is a table entry and re-routing it is free: a tenant keeps its engine while that one
serves; a tenant whose engine does not serve goes to the least loaded serving one; after every change of
the pool's membership the table is rebalanced, so each serving engine serves within one tenant of the
others. A caller that finds no engine it can use waits for the next change (or its timeout).

A plain asyncio object over slot numbers: the pool (:mod:`nexus.control.health.engine_pool`) maps slots to engines.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import Counter
from collections.abc import Callable

from nexus.control.dispatch.decisions import DecisionTimes
from nexus.errors import Unavailable
from nexus.wire.messages import EngineEndpoint


class Routing:
    def __init__(self, route_wait_s: float = 300.0) -> None:
        self.routes: dict[str, int] = {}  # tenant -> slot
        self.route_wait_s = route_wait_s  # how long a caller waits for a serving engine by default
        self._changed = asyncio.Event()
        self.times = DecisionTimes()  # how long routing decisions take

    def slot_of(self, tenant: str, serving: list[int]) -> int | None:
        """The slot serving ``tenant`` (assigned to the least loaded of ``serving`` if its own is not there)."""
        with self.times.time("route"):
            return self._slot_of(tenant, serving)

    def _slot_of(self, tenant: str, serving: list[int]) -> int | None:
        slot = self.routes.get(tenant)
        if slot is None or slot not in serving:
            if not serving:
                return None
            load = Counter(self.routes.values())
            slot = min(serving, key=lambda s: (load[s], s))
            self.routes[tenant] = slot
        return slot

    def rebalance(self, tenants: list[str], serving: list[int]) -> None:
        with self.times.time("rebalance"):
            self._rebalance(tenants, serving)

    def _rebalance(self, tenants: list[str], serving: list[int]) -> None:
        """Route exactly ``tenants``, spread over ``serving``: each serves within one tenant of the others.

        Tenants whose engine still serves keep it; the others go, in the given order, to the least loaded
        engine; then the most loaded engine hands its last tenant (by name) to the least loaded until they
        are within one. O(T log T) for T tenants (a thousand tenants rebalance in milliseconds)."""
        names = set(tenants)
        self.routes = {t: s for t, s in self.routes.items() if t in names}
        if not serving:
            return
        load: dict[int, list[str]] = {s: [] for s in sorted(serving)}  # slot -> its tenants, sorted by name
        unrouted = []
        for t, s in self.routes.items():
            if s in load:
                load[s].append(t)
        for t in tenants:
            if self.routes.get(t) not in load:
                unrouted.append(t)
        for ts in load.values():
            ts.sort()

        def least() -> int:
            return min(load, key=lambda s: (len(load[s]), s))

        for t in unrouted:
            s = least()
            bisect.insort(load[s], t)
            self.routes[t] = s
        while True:
            hi, lo = max(load, key=lambda s: (len(load[s]), s)), least()
            if len(load[hi]) - len(load[lo]) <= 1:
                return
            t = load[hi].pop()
            bisect.insort(load[lo], t)
            self.routes[t] = lo

    def drop(self, tenant: str) -> None:
        self.routes.pop(tenant, None)

    def by_slot(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for tenant, slot in sorted(self.routes.items()):
            out.setdefault(slot, []).append(tenant)
        return out

    # -- waiting for a route -----------------------------------------------------------------------
    def changed(self) -> None:
        """The pool's membership changed: wake every caller waiting for a route."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, tenant: str, lookup: Callable[[], EngineEndpoint | None], stale: str | None = None,
                   timeout: float | None = None) -> EngineEndpoint:
        """``lookup()`` once it gives an engine other than ``stale`` (the one the caller could not use), or
        ``stale`` itself after one change of the pool; :class:`Unavailable` after ``timeout``."""
        limit = self.route_wait_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        waited_on_stale = False
        while True:
            ep = lookup()
            if ep is not None and (ep.engine != stale or waited_on_stale):
                return ep
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(f"no inference engine serves tenant {tenant!r} after {limit:g} s")
            # the caller failed on the engine we would route to: give the health manager a moment to see why
            waited_on_stale = ep is not None
            await self._wait_change(min(left, 1.0))

    async def _wait_change(self, timeout: float) -> None:
        ev = self._changed
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except TimeoutError:
            pass
