"""Membership of the inference pool: which engines it has, and how they join and leave.

* **Sync before join**: a new engine (scale-up or the replacement of a lost one) is started, receives
  every tenant's current weights and every pinned evaluation version, and only then serves; while it
  syncs it already receives new versions (it is a member from its start).
* **Drain before removal**: a removed engine first stops being routed to, then finishes what it
  accepted, then stops.
* **Rollback**: a scale-up that fails part way stops the engines it added; the pool is as before.
* **In place**: a lost engine is replaced in its slot, on its restarted worker when that one comes back
  in time; failed starts back off (2, 4, … 30 s) and each replacement takes one unit of the slot's
  restart budget.

Every method here runs under the pool's lock (:class:`nexus.control.health.engine_pool.EnginePool` serializes scale
operations and replacements); after every change it calls ``on_change`` (the pool re-routes).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from nexus.control.health.engine_ops import EngineMember, EngineOps, MemberState, Pin
from nexus.control.health.manager import HealthManager, RoleState
from nexus.errors import Unavailable
from nexus.wire.messages import TenantSetup

logger = logging.getLogger("nexus.engines")


class Membership:
    def __init__(self, ops: EngineOps, health: HealthManager, target: int, drain_timeout_s: float,
                 contents: Callable[[], tuple[list[TenantSetup], list[Pin]]], on_change: Callable[[], None]) -> None:
        self.ops = ops
        self.health = health
        self.target = target  # engines the pool should have
        self.drain_timeout_s = drain_timeout_s
        self._contents = contents  # what a new engine syncs before it serves: tenants' heads, pinned versions
        self._on_change = on_change
        self.members: dict[int, EngineMember] = {}
        self._epochs: Counter[int] = Counter()
        self._last_worker: dict[int, str] = {}
        self._retry_at: dict[int, float] = {}  # slot -> earliest next start after a failed one
        self._waiting_since: dict[int, float] = {}  # slot -> when it began waiting for a worker
        self._failures: Counter[int] = Counter()
        self.operations: list[dict[str, Any]] = []  # scale history (status, benchmark)

    async def scale(self, n: int) -> None:
        """Grow or shrink to ``n`` engines (``n`` >= 1)."""
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

    async def ensure(self) -> list[str]:
        """Start or replace engines until ``target`` serve; returns errors."""
        errors: list[str] = []
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

    def lost(self, address: str) -> list[EngineMember]:
        """The worker at ``address`` is gone: its engines fail."""
        lost = [m for m in self.members.values() if m.endpoint.address == address and m.state != MemberState.FAILED]
        for m in lost:
            m.state = MemberState.FAILED
            self.health.fail(m.role, "worker lost")
        if lost:
            self._on_change()
        return lost

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
            await self.ops.sync(ep, *self._contents())
        except BaseException:
            await self._discard(m)
            raise
        return m

    def _serve(self, m: EngineMember) -> None:
        m.state = MemberState.SERVING
        self.health.ready(m.role, m.endpoint.address, m.worker, reason="synced, serving")
        self._on_change()

    async def _remove(self, slot: int) -> None:
        m = self.members[slot]
        if m.state != MemberState.FAILED:
            m.state = MemberState.DRAINING
            self._on_change()  # its tenants move to the others before it stops taking requests
            try:
                await self.ops.drain(m.endpoint, self.drain_timeout_s)
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
        self._on_change()
