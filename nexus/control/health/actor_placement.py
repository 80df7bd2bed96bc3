"""Placing the actor group on ``ACTOR`` workers and rebuilding it after a loss (the supervisor's part for
the Training Model Service).

A build: the ``actor_ranks`` first ``ACTOR`` workers by name become ranks ``0..N-1``; with N > 1 rank 0's
worker binds the rendezvous socket on its own address (``OPEN_RENDEZVOUS``), then every rank joins the
group at once (``START_ACTOR`` with its rank, the world size, its local rank — its device index on its host
— and the :class:`~nexus.wire.messages.Rendezvous`), then every rank rebuilds every tenant's slot from its
durable state (checkpoint; version past the highest published), and the dispatcher re-runs the item a loss
interrupted.

With N > 1 a process belongs to one group for its life: after a rank is lost (or the ranks disagreed, or a
build failed) the survivors' processes hold a broken group, so their workers are restarted too
(:attr:`ActorGroup.stale`) and the group is rebuilt on fresh processes only. Each rank's restart takes one
unit of its role's budget. With one rank the restarted worker is the only one, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from distributed.comm import get_address_host

from nexus.control import tasks
from nexus.control.health.engine_ops import START_TIMEOUT_S
from nexus.control.health.manager import RoleState
from nexus.wire.messages import Rendezvous, SlotInfo

if TYPE_CHECKING:
    from nexus.config.service import ServiceConfig
    from nexus.control.dispatch.dispatcher import Dispatcher
    from nexus.control.health.actor_group import ActorGroup
    from nexus.control.health.engine_pool import EnginePool
    from nexus.control.health.manager import HealthManager
    from nexus.control.runtime import DaskRuntime, WorkerInfo
    from nexus.control.tenants.offload import SlotOffload
    from nexus.control.tenants.registry import TenantRegistry

logger = logging.getLogger("nexus.supervisor")

RESTART_RETRY_S = 60.0  # a stale worker still in the cluster this long after its restart is restarted again


def local_ranks(addresses: list[str]) -> list[int]:
    """Each rank's index among the ranks on its host (its device index there: one GPU per rank)."""
    seen: dict[str, int] = {}
    out = []
    for a in addresses:
        host = get_address_host(a)
        out.append(seen.get(host, 0))
        seen[host] = out[-1] + 1
    return out


class ActorPlacement:
    def __init__(self, config: ServiceConfig, runtime: DaskRuntime, health: HealthManager, actors: ActorGroup,
                 pool: EnginePool, registry: TenantRegistry, dispatcher: Dispatcher,
                 offload: SlotOffload | None = None) -> None:
        self.config = config
        self.offload = offload  # tenants whose slots are on disk: not rebuilt, restored at their next item
        self.runtime = runtime
        self.health = health
        self.actors = actors
        self.pool = pool
        self.registry = registry
        self.dispatcher = dispatcher
        self.restarting: dict[str, float] = {}  # stale worker address -> when its restart was asked
        self._retry_at = 0.0

    def worker_removed(self, address: str) -> None:
        self.restarting.pop(address, None)

    def _restart_stale(self) -> None:
        """Restart the workers whose process holds a broken group (their roles fail with the reason)."""
        a, now = self.actors, time.monotonic()
        for address in a.stale:
            for r in self.health.on_role(address):
                if r.kind == "actor" and r.state != RoleState.FAILED:
                    self.health.fail(r.role, f"the actor group is rebuilt ({a.broken_reason})")
            self.restarting[address] = now - RESTART_RETRY_S  # restarted just below
        a.stale = []
        for address, asked in list(self.restarting.items()):
            if not self.runtime.has_worker(address):
                del self.restarting[address]
            elif now - asked >= RESTART_RETRY_S:
                logger.warning("restarting actor worker %s: the group is rebuilt on fresh processes", address)
                self.restarting[address] = now
                self.runtime.spawn(self.runtime.restart_worker(address))

    async def ensure(self) -> None:
        a = self.actors
        if a.ready:
            return
        self._restart_stale()
        workers = [w for w in self.runtime.workers("ACTOR") if w.address not in self.restarting][: a.world_size]
        if len(workers) < a.world_size or time.monotonic() < self._retry_at:
            return  # wait for the nanny (or an operator) to bring the worker back
        for role in a.roles:
            h = self.health.register(role, "actor")
            if h.state == RoleState.FAILED and not self.health.begin_restart(role, "rebuilding the actor group"):
                a.set_unavailable(f"{role}: restart budget spent")
                return
        for role, w in zip(a.roles, workers, strict=True):
            self.health.register(role, "actor", w.address, w.name)
        ready = [t.setup() for t in self.registry if t.phase == "ready"]
        offloaded = self.offload.offloaded if self.offload is not None else set()
        setups = [s for s in ready if s.name not in offloaded]
        gone = [s.name for s in ready if s.name in offloaded]
        addresses = [w.address for w in workers]
        try:
            await asyncio.wait_for(self._start(addresses), START_TIMEOUT_S)
            res = await asyncio.wait_for(a.run_on(addresses, tasks.REBUILD_SLOTS, lambda r: (setups, gone),
                                                  key=f"nexus-rebuild-{a.epoch + 1}"), START_TIMEOUT_S)
        except Exception as e:
            self._failed(addresses, e)
            return
        self._ready(workers, res)

    async def _start(self, addresses: list[str]) -> None:
        a, epoch = self.actors, self.actors.epoch + 1
        if a.world_size == 1:
            await a.run_on(addresses, tasks.START_ACTOR, lambda r: (self.config, r, 1),
                           key=f"nexus-actor-start-{epoch}")
            return
        port = await a.run_on(addresses[:1], tasks.OPEN_RENDEZVOUS, lambda r: (), key=f"nexus-rendezvous-{epoch}")
        rv = Rendezvous(get_address_host(addresses[0]), int(port), a.world_size, epoch)
        local = local_ranks(addresses)
        await a.run_on(addresses, tasks.START_ACTOR, lambda r: (self.config, r, a.world_size, rv, local[r]),
                       key=f"nexus-actor-start-{epoch}")

    def _failed(self, addresses: list[str], e: Exception) -> None:
        a = self.actors
        for role in a.roles:
            self.health.fail(role, f"rebuild failed: {type(e).__name__}: {e}")
        if a.world_size > 1:  # a group half formed: every rank starts again on a fresh process
            a.broken_reason = f"its build failed: {type(e).__name__}"
            a.stale = sorted(set(a.stale) | set(addresses))
        self._retry_at = time.monotonic() + 5.0

    def _ready(self, workers: list[WorkerInfo], res: dict) -> None:
        a = self.actors
        for info in res["slots"]:
            self._restored(info)
        for name, err in res["errors"].items():
            self.health.error(a.roles[0], f"slot {name}: {err}")
        a.set_ready([w.address for w in workers], [w.name for w in workers])
        for role, w in zip(a.roles, workers, strict=True):
            self.health.ready(role, w.address, w.name, reason=f"slots rebuilt ({len(res['slots'])} tenants)")
        self.dispatcher.pump()

    def _restored(self, info: SlotInfo) -> None:
        t = self.registry.find(info.tenant)
        if t is None:
            return
        before = t.version
        self.registry.publish(info.tenant, info.version)
        if t.version > before:  # an update finished on the lost worker after its last report
            self.runtime.spawn(self.pool.on_published(t.setup(), ()))
