"""Supervisor: places every role, watches the health manager, restarts failed roles in place.

A reconcile loop (level-triggered, one pass at a time, woken by worker joins/leaves and every
second) brings the service to its desired shape:

* **actor group** — ``actor_ranks`` ranks on ``ACTOR`` workers, one torch.distributed group; after a
  loss, the group is rebuilt on the restarted workers (with N > 1 every rank's: a survivor's group is
  broken) — every tenant's slot from its durable state (checkpoint, version past the highest
  published), then the dispatcher re-runs the interrupted item (:mod:`nexus.control.health.actor_placement`);
* **inference pool** — ``target`` engines (:meth:`EnginePool.ensure`: a lost engine is replaced in its
  slot, preferring the restarted worker of the same name, and re-synced before it serves);
* **tracker** — one MLflow tracker; a new one reopens the known runs (:class:`TrackerLink`);
* **simulators** — ``sim/<worker>`` roles follow their workers (Dask re-runs their rollouts on any SIM
  worker, one that joined later included); one whose worker left for good is retired;
* at boot, once the actor group is up, tenants are **rediscovered** from the root's output dirs and
  jobs a crashed service left running are marked failed (records, manifest, MLflow):
  :mod:`nexus.control.tenants.discovery`.

Engines are started and driven through :class:`nexus.control.health.engine_ops.DaskEngineOps`.

A role without heartbeats for ``fail_after_s`` is failed and its worker restarted by its nanny.
Each restart takes one unit of the role's budget; once spent, the role stays failed and status asks
for a global restart (``nexus up`` on the same root).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from nexus.control import tasks
from nexus.control.health.actor_placement import ActorPlacement
from nexus.control.health.engine_ops import START_TIMEOUT_S
from nexus.control.health.manager import RoleState
from nexus.control.tenants.discovery import Rediscovery
from nexus.wire.messages import Heartbeat

if TYPE_CHECKING:
    from nexus.config.service import ServiceConfig
    from nexus.control.dispatch.dispatcher import Dispatcher
    from nexus.control.health.actor_group import ActorGroup
    from nexus.control.health.engine_pool import EnginePool
    from nexus.control.health.manager import HealthManager
    from nexus.control.jobs.manager import JobManager
    from nexus.control.monitoring.tracking_link import TrackerLink
    from nexus.control.runtime import DaskRuntime
    from nexus.control.tenants.lifecycle import TenantLifecycle
    from nexus.control.tenants.offload import SlotOffload
    from nexus.control.tenants.registry import TenantRegistry

logger = logging.getLogger("nexus.supervisor")

TRACKER_GRACE_S = 30.0  # how long the tracker waits for a worker of its role (TRACK, INFER or ACTOR)


class Supervisor:
    def __init__(self, config: ServiceConfig, runtime: DaskRuntime, health: HealthManager, actors: ActorGroup,
                 pool: EnginePool, registry: TenantRegistry, tracker: TrackerLink, dispatcher: Dispatcher,
                 lifecycle: TenantLifecycle, jobs: JobManager, offload: SlotOffload | None = None) -> None:
        self.config = config
        self.runtime = runtime
        self.health = health
        self.actors = actors
        self.pool = pool
        self.registry = registry
        self.tracker = tracker
        self.dispatcher = dispatcher
        self.offload = offload
        self.boot_time = time.time()
        self.rediscovery = Rediscovery(str(config.root), self.boot_time, actors, registry, lifecycle, jobs, tracker)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._tracker_starts = 0
        self._tracker_retry_at = 0.0
        self._tracker_role = "TRACK" if config.resolved_tracker_worker() else "INFER"  # the workers it goes on
        self._tracker_role_seen = self.boot_time  # when a worker of that role was last in the cluster
        self.placement = ActorPlacement(config, runtime, health, actors, pool, registry, dispatcher, offload)
        self._producer_requests: dict[str, int] = {}
        for role in actors.roles:
            health.register(role, "actor")
        health.register("tracker", "tracker")

    # -- loop ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.rediscovery.close()

    @property
    def discovery(self) -> dict[str, Any]:
        """Rediscovery at boot: ``{"state": "pending" | "running" | "done" | "failed", ...}``."""
        return self.rediscovery.state

    def apply(self, config: ServiceConfig) -> None:
        """A new scheduler: an actor group or tracker started from now on gets its settings."""
        self.config = config
        self.placement.config = self.config

    def wake(self) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("reconcile failed")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), 1.0)
            except TimeoutError:
                pass

    async def reconcile(self) -> None:
        for r in self.health.tick():
            if r.address is not None:
                address = r.address
                logger.warning("%s: %s; restarting worker %s", r.role, r.reason, address)
                self.on_worker_removed(address, reason=r.reason)
                self.runtime.spawn(self.runtime.restart_worker(address))
        self.health.retire_departed("simulator", self.health.settings.fail_after_s)  # hosts that left for good
        await self.placement.ensure()
        await self._ensure_tracker()
        errors = await self.pool.ensure()
        for e in errors:
            logger.warning("inference pool: %s", e)
        if self.actors.ready:
            self.rediscovery.start()

    # -- Dask hooks (via the plugin) ------------------------------------------------------------------
    def on_worker_added(self, address: str) -> None:
        ws = self.runtime.scheduler.workers.get(address)
        if ws is not None and ws.resources.get("SIM", 0) > 0:
            role = f"sim/{ws.name}"
            h = self.health.register(role, "simulator")
            if h.state == RoleState.FAILED and not self.health.begin_restart(role, "restarted by its nanny"):
                h.address, h.worker = address, str(ws.name)  # over budget: shown failed, still used by Dask
            else:
                self.health.ready(role, address, str(ws.name), reason="worker joined")
        self.wake()

    def on_worker_removed(self, address: str, reason: str = "worker lost") -> None:
        for r in self.health.on_role(address):
            if r.state != RoleState.FAILED:
                self.health.fail(r.role, reason)
        self.health.worker_lost(address)
        self.placement.worker_removed(address)
        self.actors.lost(address)  # the dispatcher holds new items until the group is rebuilt
        self.pool.member_lost(address)
        if self.tracker.address == address:
            self.tracker.lost()
        self.wake()

    def on_restart(self) -> None:
        """``Client.restart()``: every worker restarts, so every role is lost."""
        for address in list(self.runtime.scheduler.workers):
            self.on_worker_removed(address, reason="cluster restart")

    def on_heartbeat(self, msg: dict[str, Any]) -> None:
        hb = Heartbeat.from_dict(msg)
        detail: dict[str, dict[str, Any]] = {}
        for e in hb.engines:
            m = self.pool.member_of(e["engine"])
            if m is not None:
                detail[m.role] = e
        if hb.training:
            for role, addr in zip(self.actors.roles, self.actors.addresses, strict=False):
                if addr == hb.address:
                    detail[role] = {"slots": hb.slots, "executing": hb.executing}
        self.health.heartbeat(hb.address, detail, now=None)
        for p in hb.producers:
            key = f"{p['job']}@{hb.address}"
            if p["requests"] != self._producer_requests.get(key):
                self._producer_requests[key] = p["requests"]
                self.health.progress(f"producer/{p['job']}", requests=p["requests"])

    # -- tracker ----------------------------------------------------------------------------------------
    async def _ensure_tracker(self) -> None:
        h = self.health.register("tracker", "tracker")
        own = self.runtime.workers(self._tracker_role)
        if own:
            self._tracker_role_seen = time.time()
        if self.tracker.address is not None and h.state != RoleState.FAILED:
            return
        # on its own worker (cluster.tracker_worker: TRACK, at a lower CPU priority, so that MLflow's logging and
        # plots never hold the interpreter lock of a device's worker), else on an INFER worker (as in the paper's
        # layout); on any worker once none has been there for a grace period (since the boot, or since the last one
        # left: a restarting worker of its role is waited for)
        workers = own or (self.runtime.workers() if time.time() - self._tracker_role_seen > TRACKER_GRACE_S else [])
        if not workers or time.monotonic() < self._tracker_retry_at:
            return
        if h.state == RoleState.FAILED and not self.health.begin_restart("tracker"):
            return
        same = [w for w in workers if w.name == h.worker]
        engines = {m.endpoint.address for m in self.pool.members.values()}
        w = same[0] if same else min(workers, key=lambda w: (w.address in engines, w.name))
        self._tracker_starts += 1
        try:
            info = await asyncio.wait_for(
                self.runtime.run(tasks.START_TRACKER, self.config,
                                 key=f"nexus-tracker-start-{self._tracker_starts}", workers=[w.address]),
                START_TIMEOUT_S)
        except Exception as e:
            self.health.fail("tracker", f"start failed: {type(e).__name__}: {e}")
            self._tracker_retry_at = time.monotonic() + 5.0
            return
        self.health.ready("tracker", info["address"], info["worker"], reason="runs reopened" if self.tracker.runs
                          else "serving")
        self.tracker.attach(info["address"])
