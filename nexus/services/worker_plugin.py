"""Per-process state of a Nexus worker, as a Dask ``WorkerPlugin``, and the roles it hosts.

One plugin per worker process holds everything that used to be module globals: the training model
service (actor ranks), the simulator cache (rollout producers), the inference engines and the MLflow
tracker this process hosts, and the progress of running producers. It registers the worker's Nexus
RPC handlers and sends a heartbeat every ``HEARTBEAT_S`` listing its roles (a Dask event the
scheduler's health manager reads). When the process dies, all of it dies with it; the control plane
rebuilds the roles elsewhere or on the restarted process.

Handlers (plain msgpack from the scheduler; ``nexus_engine`` carries pickled payloads between workers):

* ``nexus_engine(engine, method, payload)`` — an engine call from a worker or client (predict,
  load_weights, engine_stats, ...); ``predict`` is refused with ``Draining`` once the engine drains and
  with ``SpecError`` when its observation does not fit the tenant's schema (before it joins a group).
* ``nexus_engine_ctl(engine, action, ...)`` — the control plane's engine operations: sync, drain, stop,
  unregister, pin, unpin, stats, flush_signals, batching (T and B of a new scheduling policy).
* ``nexus_tracker(calls)`` — an ordered batch of tracker calls.
* ``nexus_io(action, ...)`` — small file writes (job records), in a thread.

Load it with ``dask worker --preload nexus.services.worker_plugin``; tasks install it on demand
(:func:`state`) on workers started without it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from nexus.errors import Draining, NotFound, SpecError
from nexus.messages import HEALTH_TOPIC, HEARTBEAT_S, EngineReport, Heartbeat, ProducerReport, TenantSetup

logger = logging.getLogger("nexus.worker")

PLUGIN_NAME = "nexus"


@dataclass
class ProducerProgress:
    job: str
    tenant: str
    kind: str
    requests: int = 0
    t_progress: float = 0.0

    def tick(self) -> None:
        self.requests += 1
        self.t_progress = time.time()


class EngineHost:
    """One inference engine in this process, with the gate every request passes before it may join a group."""

    def __init__(self, plugin: NexusWorkerPlugin, engine_id: str, config: dict[str, Any]) -> None:
        from nexus.services.inference import InferenceEngine

        self.plugin = plugin
        self.id = engine_id
        self.engine = InferenceEngine(config)
        self.schemas: dict[str, Any] = {}
        self.draining = False
        self.inflight = 0
        self.served = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._pins: Counter[tuple[str, int]] = Counter()

    def report(self) -> dict[str, Any]:
        return EngineReport(self.id, len(self.schemas), self.inflight, self.served, self.draining).to_dict()

    # -- data path ---------------------------------------------------------------------------------
    async def predict(self, tenant: str, obs: Any, version: int | None = None, deterministic: bool = False,
                      job: str | None = None, request_id: str | None = None) -> dict[str, Any]:
        work = self.engine.predict(tenant, obs, version, deterministic, job)
        return await self._serve(tenant, [obs], request_id, work)

    async def predict_batch(self, tenant: str, observations: list, *args: Any, request_id: str | None = None,
                            **kwargs: Any) -> dict[str, Any]:
        """A producer's K observations as one request (``InferenceEngine.predict_batch``)."""
        return await self._serve(tenant, observations, request_id,
                                 self.engine.predict_batch(tenant, observations, *args, **kwargs))

    async def _serve(self, tenant: str, observations: list, request_id: str | None, work) -> dict[str, Any]:
        """The gate of every action request: refused while draining or for an unknown tenant, and each
        observation checked against the tenant's schema before it may join a group."""
        from nexus.services.request_check import check_request

        try:
            if self.draining:
                raise Draining(f"inference engine {self.id} is draining")
            schema = self.schemas.get(tenant)
            if schema is None:
                raise NotFound(f"tenant {tenant!r} is not registered on inference engine {self.id}")
            if not isinstance(observations, list) or not observations:
                raise SpecError(f"tenant {tenant!r}: an action request needs at least one observation")
            for obs in observations:
                check_request(obs, schema, tenant)  # a bad request fails alone, before it joins a group
        except BaseException:
            work.close()  # never started
            raise
        self.inflight += 1
        self._idle.clear()
        try:
            out = await work
        except OSError as e:  # e.g. a missing weights file: not a comm failure, do not re-route
            raise RuntimeError(f"{type(e).__name__}: {e}") from None
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()
        self.served += 1
        if request_id is not None:
            self.plugin.served_log.append((self.id, request_id))
        return out

    async def load_weights(self, tenant: str, version: int, weights: bytes) -> int:
        """A new version from the actor; versions older than the one held are ignored (late pushes).
        None for a tenant this engine does not hold yet (it is syncing: the pool catches it up)."""
        if tenant not in self.schemas:
            return None
        async with self._lock(tenant):
            live = self.engine.versions()["live"].get(tenant)
            if live is not None and live >= version:
                return live
            return await self.engine.load_weights(tenant, version, weights)

    async def call(self, method: str, args: list, kwargs: dict) -> Any:
        if method in ("predict", "predict_batch", "load_weights"):  # gated here (draining, schema, late pushes)
            return await getattr(self, method)(*args, **kwargs)
        if method.startswith("_"):
            raise AttributeError(f"engine method {method!r} is private")
        fn = getattr(self.engine, method)
        out = fn(*args, **kwargs)
        return await out if asyncio.iscoroutine(out) else out

    # -- control -----------------------------------------------------------------------------------
    def _lock(self, tenant: str) -> asyncio.Lock:
        return self._locks.setdefault(tenant, asyncio.Lock())

    async def sync(self, tenants: list[dict[str, Any]], pins: list[list[Any]]) -> dict[str, Any]:
        """Hold every given tenant at (at least) its given version, and the given pins, read from the
        tenants' durable weights."""
        from nexus.control.validation import schema_from_dict
        from nexus.data.output_dir import TenantOutputDir

        for d in tenants:
            s = TenantSetup(**d)
            async with self._lock(s.name):
                live = self.engine.versions()["live"].get(s.name)
                if live is not None and live >= s.version:
                    continue
                weights = await asyncio.to_thread(TenantOutputDir(s.output_dir).weights_path(s.version).read_bytes)
                if live is None:
                    await self.engine.register_tenant(s.spec, s.schema, s.version, weights)
                    self.schemas[s.name] = schema_from_dict(s.schema)
                else:
                    await self.engine.load_weights(s.name, s.version, weights)
        for tenant, version, output_dir, count in pins:
            for _ in range(int(count) - self._pins[(tenant, version)]):
                await self.pin(tenant, int(version), output_dir)
        return self.engine.versions()

    async def pin(self, tenant: str, version: int, output_dir: str) -> None:
        await self.engine.pin(tenant, version, output_dir)
        self._pins[(tenant, version)] += 1

    async def unpin(self, tenant: str, version: int) -> None:
        if self._pins[(tenant, version)] > 0:
            self._pins[(tenant, version)] -= 1
            await self.engine.unpin(tenant, version)

    async def unregister(self, tenant: str) -> None:
        self.schemas.pop(tenant, None)
        for key in [k for k in self._pins if k[0] == tenant]:
            del self._pins[key]
        await self.engine.unregister_tenant(tenant)

    async def drain(self, timeout: float) -> dict[str, Any]:
        """Refuse new requests, answer the accepted ones."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            logger.warning("engine %s: %d requests still in flight after %g s of draining", self.id,
                           self.inflight, timeout)
        await self.engine.flush_signals()
        return {"served": self.served, "inflight": self.inflight}

    async def stop(self) -> None:
        self.draining = True
        await self.engine.flush_signals()
        self.engine._model_thread.shutdown(wait=False)


class TrackerHost:
    """The MLflow tracker of the service; its calls run one after another in its own thread."""

    METHODS = frozenset({"start_run", "log_metrics", "end_run", "flush", "reopen", "fail_interrupted"})

    def __init__(self, config: dict[str, Any]) -> None:
        from nexus.services.tracking import Tracker

        self.tracker = Tracker(config)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="nexus-tracker")

    async def run(self, calls: list[list[Any]]) -> list[Any]:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._run_all, calls)

    def _run_all(self, calls: list[list[Any]]) -> list[Any]:
        """The calls in order; each run of consecutive ``log_metrics`` is one write per MLflow run."""
        out: list[Any] = []
        for method, group in itertools.groupby(calls, key=lambda c: c[0]):
            group = list(group)
            if method == "log_metrics":
                self._call("log_metrics_many", {"rows": [kw for _, kw in group]})
                out += [None] * len(group)
            else:
                out += [self._call(method, kw) if method in self.METHODS else None for _, kw in group]
        return out

    def _call(self, method: str, kwargs: dict[str, Any]) -> Any:
        try:
            return getattr(self.tracker, method)(**kwargs)
        except Exception as e:  # one bad call must not lose the batch
            logger.error("tracker %s failed: %s", method, e)
            return None


class NexusWorkerPlugin(WorkerPlugin):
    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.worker = None
        self._lock = threading.Lock()
        self._training = None
        self._envs = None  # EnvPool, on the first rollout
        self.engines: dict[str, EngineHost] = {}
        self.tracker: TrackerHost | None = None
        self.producers: dict[str, ProducerProgress] = {}
        self.served_log: deque[tuple[str, str]] = deque(maxlen=200_000)  # (engine, request id) answered here
        self._beat = None

    # -- Dask hooks --------------------------------------------------------------------------------
    def setup(self, worker) -> None:
        from tornado.ioloop import PeriodicCallback

        self.worker = worker
        worker.handlers.update({"nexus_engine": self._in_worker(self._h_engine),
                                "nexus_engine_ctl": self._in_worker(self._h_engine_ctl),
                                "nexus_tracker": self._h_tracker, "nexus_io": self._h_io})
        self._beat = PeriodicCallback(self.beat, HEARTBEAT_S * 1000)
        self._beat.start()
        self.beat()

    def _in_worker(self, fn):
        """Run a handler as Dask runs actor methods: ``get_worker()`` works in it (and in the tasks and
        timers it starts), so the engine's monitoring signals reach the scheduler."""
        from distributed.worker import _worker_cvar  # Dask sets the same variable around tasks and actors

        async def handler(**msg: Any) -> Any:
            token = _worker_cvar.set(self.worker)
            try:
                return await fn(**msg)
            finally:
                _worker_cvar.reset(token)

        handler.__name__ = fn.__name__
        return handler

    def teardown(self, worker) -> None:
        if self._beat is not None:
            self._beat.stop()

    def beat(self) -> None:
        w = self.worker
        if w is None or w.status.name not in ("running", "paused"):
            return
        hb = Heartbeat(worker=str(w.name), address=w.address, t=time.time(), training=self._training is not None,
                       slots=len(self._training.slots) if self._training is not None else 0,
                       tracker=self.tracker is not None, engines=[e.report() for e in self.engines.values()],
                       producers=[ProducerReport(p.job, p.tenant, p.kind, p.requests, p.t_progress).to_dict()
                                  for p in self.producers.values()],
                       executing=[str(ts.key) for ts in w.state.executing])
        w.log_event(HEALTH_TOPIC, hb.to_dict())

    # -- per-process state (used by tasks, from worker threads) ---------------------------------------
    @property
    def training_built(self):
        """This process's training model service if it hosts one (None otherwise); never builds it."""
        return self._training

    def training(self):
        """The training model service of this process (frozen backbone + tenant slots), built once."""
        with self._lock:
            if self._training is None:
                from nexus.services.training import TrainingModelService

                self._training = TrainingModelService()
            return self._training

    def env_pool(self):
        """Idle simulators of this process, reused across its rollout tasks (``nexus.services.rollout.EnvPool``)."""
        with self._lock:
            if self._envs is None:
                from nexus.services.rollout import EnvPool

                self._envs = EnvPool()
            return self._envs

    @contextmanager
    def producer(self, key: str, job: str, tenant: str, kind: str) -> Iterator[ProducerProgress]:
        p = self.producers[key] = ProducerProgress(job, tenant, kind, t_progress=time.time())
        try:
            yield p
        finally:
            if self.producers.get(key) is p:
                del self.producers[key]

    # -- handlers ------------------------------------------------------------------------------------
    def _engine(self, engine: str) -> EngineHost:
        host = self.engines.get(engine)
        if host is None:  # stopped or never here: the caller asks for the tenant's route again
            raise Draining(f"inference engine {engine} is not hosted by worker {self.worker.name}")
        return host

    async def _h_engine(self, engine: str, method: str, payload: dict[str, Any]) -> dict[str, Any]:
        from distributed.protocol import to_serialize

        out = await self._engine(engine).call(method, payload.get("args", []), payload.get("kwargs", {}))
        return {"result": to_serialize(out)}

    async def _h_engine_ctl(self, engine: str, action: str, **msg: Any) -> Any:
        op = action
        host = self._engine(engine)
        if op == "sync":
            return await host.sync(msg.get("tenants", []), msg.get("pins", []))
        if op == "drain":
            return await host.drain(float(msg.get("drain_timeout", 120.0)))
        if op == "stop":
            await host.stop()
            self.engines.pop(engine, None)
            return True
        if op == "unregister":
            await host.unregister(msg["tenant"])
            return True
        if op == "pin":
            await host.pin(msg["tenant"], int(msg["version"]), msg["output_dir"])
            return True
        if op == "unpin":
            await host.unpin(msg["tenant"], int(msg["version"]))
            return True
        if op == "stats":
            return {**host.engine.engine_stats(), **host.report()}
        if op == "flush_signals":
            return await host.engine.flush_signals()
        if op == "batching":
            return host.engine.set_batching(float(msg["max_wait_s"]), int(msg["max_batch"]))
        raise ValueError(f"unknown engine op {op!r}")

    async def _h_tracker(self, calls: list[list[Any]]) -> list[Any]:
        if self.tracker is None:
            raise Draining(f"no tracker on worker {self.worker.name}")
        return await self.tracker.run(calls)

    async def _h_io(self, action: str, **msg: Any) -> Any:
        from nexus.data.output_dir import TenantOutputDir

        if action == "write_job_record":
            await asyncio.to_thread(TenantOutputDir(msg["output_dir"]).write_job, msg["record"])
            return True
        raise ValueError(f"unknown io action {action!r}")


_local = NexusWorkerPlugin()  # outside a Dask worker (scripts, unit tests): one per process


def state() -> NexusWorkerPlugin:
    """This process's Nexus state; installs the plugin on a worker started without the preload."""
    from distributed import get_worker
    from distributed.utils import sync

    try:
        worker = get_worker()
    except ValueError:
        return _local
    plugin = worker.plugins.get(PLUGIN_NAME)
    if plugin is None:
        sync(worker.loop, worker.plugin_add, NexusWorkerPlugin(), PLUGIN_NAME)
        plugin = worker.plugins[PLUGIN_NAME]
    return plugin


# -- tasks that place a role in this process (named by import path in nexus.control.tasks) ------------
def start_engine(engine_id: str, config: dict[str, Any]) -> dict[str, Any]:
    """Host a new inference engine here (its backbone is built at its first sync)."""
    from distributed import get_worker
    from distributed.utils import sync

    plugin = state()
    worker = get_worker()

    async def create() -> None:  # on the loop: the engine's asyncio objects belong to it
        plugin.engines[engine_id] = EngineHost(plugin, engine_id, config)

    sync(worker.loop, create)
    return {"engine": engine_id, "address": worker.address, "worker": str(worker.name)}


def start_tracker(config: dict[str, Any]) -> dict[str, Any]:
    from distributed import get_worker

    plugin = state()
    worker = get_worker()
    plugin.tracker = TrackerHost(config)
    return {"address": worker.address, "worker": str(worker.name)}


async def dask_setup(worker) -> None:
    """``dask worker --preload nexus.services.worker_plugin``."""
    root = logging.getLogger("nexus")
    if not root.handlers:  # Nexus's loggers write next to Dask's in the worker's log
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s - %(name)s - %(levelname)s - %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    await worker.plugin_add(NexusWorkerPlugin(), name=PLUGIN_NAME)
