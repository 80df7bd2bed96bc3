"""Supervisor: places every role, watches the health manager, restarts failed roles in place.

A reconcile loop (level-triggered, one pass at a time, woken by worker joins/leaves and every
second) brings the service to its desired shape:

* **actor group** — ``actor_ranks`` ranks on ``ACTOR`` workers; after a loss, the group is rebuilt on
  the restarted worker: every tenant's slot from its durable state (checkpoint, version past the
  highest published), then the dispatcher re-runs the interrupted item;
* **inference pool** — ``target`` engines (:meth:`EnginePool.ensure`: a lost engine is replaced in its
  slot, preferring the restarted worker of the same name, and re-synced before it serves);
* **tracker** — one MLflow tracker; a new one reopens the known runs (:class:`TrackerLink`);
* **simulators** — ``sim/<worker>`` roles follow their workers (Dask re-runs their rollouts);
* at boot, once the actor group is up, tenants are **rediscovered** from the root's output dirs and
  jobs a crashed service left running are marked failed (records, manifest, MLflow).

A role without heartbeats for ``fail_after_s`` is failed and its worker restarted by its nanny.
Each restart takes one unit of the role's budget; once spent, the role stays failed and status asks
for a global restart (``nexus up`` on the same root).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from nexus.control import tasks
from nexus.control.health import RoleState
from nexus.messages import EngineEndpoint, Heartbeat, SlotInfo, TenantSetup

if TYPE_CHECKING:
    from nexus.config import ServiceConfig
    from nexus.control.actors import ActorGroup
    from nexus.control.dispatcher import Dispatcher
    from nexus.control.engines import EnginePool, Pin
    from nexus.control.health import HealthManager
    from nexus.control.jobs import JobManager
    from nexus.control.lifecycle import TenantLifecycle
    from nexus.control.runtime import DaskRuntime
    from nexus.control.tenants import TenantRegistry
    from nexus.control.tracking_link import TrackerLink

logger = logging.getLogger("nexus.supervisor")

START_TIMEOUT_S = 180.0
TRACKER_GRACE_S = 30.0  # how long the tracker waits for an INFER worker at boot
PLACEMENT_GRACE_S = 30.0  # how long a role waits for its own (restarting) or a free worker


class DaskEngineOps:
    """:class:`nexus.control.engines.EngineOps` over the cluster: engines live in workers' Nexus plugins."""

    def __init__(self, runtime: DaskRuntime, config: ServiceConfig) -> None:
        self.runtime = runtime
        self.config = config  # the master's: an engine starts with its settings of the moment (a new T, B)

    def place(self, prefer_worker: str | None, load: dict[str, int], waited_s: float) -> str | None:
        """In place first: a lost engine waits (up to ``PLACEMENT_GRACE_S``) for its restarted worker of
        the same name; a new one prefers a worker without an engine, and waits as long for one to join."""
        workers = self.runtime.workers("INFER")
        if not workers:
            return None
        same = [w for w in workers if w.name == prefer_worker]
        if same:
            return same[0].address
        best = min(workers, key=lambda w: (load.get(w.address, 0), w.name))
        if waited_s < PLACEMENT_GRACE_S and (prefer_worker is not None or load.get(best.address, 0) > 0):
            return None
        return best.address

    async def start(self, slot: int, epoch: int, address: str) -> tuple[EngineEndpoint, str]:
        engine_id = f"engine-{slot}.{epoch}"
        info = await asyncio.wait_for(self.runtime.run(tasks.START_ENGINE, engine_id, self.config.model_dump(),
                                                       key=f"nexus-engine-start-{engine_id}", workers=[address]),
                                      START_TIMEOUT_S)
        return EngineEndpoint(engine_id, info["address"]), info["worker"]

    async def _ctl(self, ep: EngineEndpoint, action: str, timeout: float = 300.0, **msg: Any) -> Any:
        return await self.runtime.call(ep.address, "nexus_engine_ctl", timeout=timeout, engine=ep.engine,
                                       action=action, **msg)

    async def sync(self, ep: EngineEndpoint, tenants: list[TenantSetup], pins: list[Pin]) -> None:
        await self._ctl(ep, "sync", tenants=[asdict(t) for t in tenants], pins=[list(p) for p in pins])

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


class Supervisor:
    def __init__(self, config: ServiceConfig, runtime: DaskRuntime, health: HealthManager, actors: ActorGroup,
                 pool: EnginePool, registry: TenantRegistry, tracker: TrackerLink, dispatcher: Dispatcher) -> None:
        self.config = config
        self.runtime = runtime
        self.health = health
        self.actors = actors
        self.pool = pool
        self.registry = registry
        self.tracker = tracker
        self.dispatcher = dispatcher
        self.lifecycle: TenantLifecycle | None = None  # set by the Master (they need each other)
        self.jobs: JobManager | None = None
        self.boot_time = time.time()
        self.discovery: dict[str, Any] = {"state": "pending"}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._discovery_task: asyncio.Task | None = None
        self._tracker_starts = 0
        self._tracker_retry_at = 0.0
        self._actor_retry_at = 0.0
        self._producer_requests: dict[str, int] = {}
        for role in actors.roles:
            health.register(role, "actor")
        health.register("tracker", "tracker")

    # -- loop ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        for t in (self._task, self._discovery_task):
            if t is not None:
                t.cancel()

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
        await self._ensure_actor()
        await self._ensure_tracker()
        errors = await self.pool.ensure()
        for e in errors:
            logger.warning("inference pool: %s", e)
        if self.actors.ready and self.discovery["state"] == "pending" and self.lifecycle is not None:
            self.discovery["state"] = "running"
            self._discovery_task = asyncio.get_running_loop().create_task(self._discover())

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

    # -- actor group ------------------------------------------------------------------------------------
    async def _ensure_actor(self) -> None:
        a = self.actors
        if a.ready:
            return
        workers = self.runtime.workers("ACTOR")[: a.world_size]
        if len(workers) < a.world_size or time.monotonic() < self._actor_retry_at:
            return  # wait for the nanny (or an operator) to bring the worker back
        for role in a.roles:
            h = self.health.register(role, "actor")
            if h.state == RoleState.FAILED and not self.health.begin_restart(role, "rebuilding the actor group"):
                a.set_unavailable(f"{role}: restart budget spent")
                return
        for role, w in zip(a.roles, workers, strict=True):
            self.health.register(role, "actor", w.address, w.name)
        setups = [t.setup() for t in self.registry if t.phase == "ready"]
        addresses = [w.address for w in workers]
        try:
            res = await asyncio.wait_for(a.run_on(addresses, tasks.REBUILD_SLOTS, lambda r: (setups,),
                                                  key=f"nexus-rebuild-{a.epoch + 1}"), START_TIMEOUT_S)
        except Exception as e:
            for role in a.roles:
                self.health.fail(role, f"rebuild failed: {type(e).__name__}: {e}")
            self._actor_retry_at = time.monotonic() + 5.0
            return
        for info in res["slots"]:
            self._restored(info)
        for name, err in res["errors"].items():
            self.health.error(a.roles[0], f"slot {name}: {err}")
        a.set_ready(addresses, [w.name for w in workers])
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

    # -- tracker ----------------------------------------------------------------------------------------
    async def _ensure_tracker(self) -> None:
        h = self.health.register("tracker", "tracker")
        if self.tracker.address is not None and h.state != RoleState.FAILED:
            return
        # on an INFER worker (as in the paper's layout); on any worker if none came within a grace period
        workers = self.runtime.workers("INFER") or (
            self.runtime.workers() if time.time() - self.boot_time > TRACKER_GRACE_S else [])
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
                self.runtime.run(tasks.START_TRACKER, self.config.model_dump(),
                                 key=f"nexus-tracker-start-{self._tracker_starts}", workers=[w.address]),
                START_TIMEOUT_S)
        except Exception as e:
            self.health.fail("tracker", f"start failed: {type(e).__name__}: {e}")
            self._tracker_retry_at = time.monotonic() + 5.0
            return
        self.health.ready("tracker", info["address"], info["worker"], reason="runs reopened" if self.tracker.runs
                          else "serving")
        self.tracker.attach(info["address"])

    # -- rediscovery at boot ----------------------------------------------------------------------------------
    async def _discover(self) -> None:
        """Tenants of this root from their output dirs; jobs a crashed service left running become failed."""
        assert self.lifecycle is not None and self.jobs is not None
        root = str(self.config.root)
        reason = "the service stopped while this job ran"
        found_tenants, interrupted, errors = [], [], {}
        try:
            found = await self.actors.run(tasks.DISCOVER, lambda r: (root,), key="nexus-discover", retry_lost=True)
            for f in found:
                self.jobs.ids.observe(f["job_seq"])
            for f in found:
                name = f["tenant"]
                try:
                    if f["interrupted"]:
                        marked = await self.actors.run(tasks.MARK_INTERRUPTED, lambda r, f=f: (f["output_dir"], reason),
                                                       key=f"nexus-interrupted-{name}", retry_lost=True)
                        interrupted.extend(marked)
                    spec = dict(f["spec"])
                    if self.registry.find(name) is None:
                        await self.lifecycle.create(spec)
                    found_tenants.append(name)
                except Exception as e:
                    errors[name] = f"{type(e).__name__}: {e}"
                    logger.error("rediscovering tenant %s: %s", name, e)
            self.tracker.fail_interrupted(int(self.boot_time * 1000), str(self.config.root), reason)
            self.discovery = {"state": "done", "tenants": found_tenants, "interrupted": interrupted, "errors": errors,
                              "t": time.time()}
        except Exception as e:
            self.discovery = {"state": "failed", "error": f"{type(e).__name__}: {e}"}
            logger.exception("rediscovery failed")
