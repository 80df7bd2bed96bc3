"""The worker side's Dask shell: one ``WorkerPlugin`` per worker process, holding the hosts of the roles that
process plays, with its Nexus RPC handlers and its heartbeat.

A host owns one role's state and is passed to that role's tasks (``nexus.control.tasks.TaskRef`` with a
role): :class:`~nexus.actor.host.ActorHost` (an actor rank: backbone + tenant slots),
:class:`~nexus.sim.host.SimHost` (idle simulators and running producers),
:class:`~nexus.engine.host.EngineHost` (one inference engine each) and
:class:`~nexus.tracking.host.TrackerHost` (the MLflow tracker). When the process dies all of it
dies with it; the control plane rebuilds the roles elsewhere or on the restarted process.

Handlers (plain msgpack from the scheduler; pickled payloads where marked):

* ``nexus_engine(engine, method, payload)`` — an engine call from a worker or client (predict,
  load_weights, engine_stats, ...; pickled payload), gated by its :class:`EngineHost`.
* ``nexus_engine_stream()`` — the address of this worker's direct stream for engine calls (started on the first
  ask; :mod:`nexus.wire.engine_stream`: the gateway's predicts), or None where the worker's comm is not TCP/TLS.
* ``nexus_engine_ctl(engine, action, ...)`` — the control plane's engine operations: sync (pickled
  ``TenantSetup`` objects), drain, stop, unregister, pin, unpin, stats, flush_signals, batching.
* ``nexus_tracker(calls)`` — an ordered batch of tracker calls.
* ``nexus_io(action, ...)`` — small file writes (job records), in a thread.

Load it with ``dask worker --preload nexus.worker.plugin``; tasks install it on workers started
without it. Module-level imports stay light: every worker loads this module, and only a worker that hosts
a role imports that role's stack (torch and DeepSpeed for an actor, a backbone for an engine, MLflow).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from distributed import get_worker
from distributed.comm import get_address_host
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol.serialize import ToPickle
from distributed.utils import sync
from distributed.worker import _worker_cvar  # Dask sets the same variable around tasks and actors
from tornado.ioloop import PeriodicCallback

from nexus.data.output_dir import TenantOutputDir, unmark_evaluation
from nexus.deploy import gc_tuning
from nexus.deploy.processes import ROLE_RESOURCES, TRACKER_NICE
from nexus.errors import Draining, NexusError, Unavailable, to_reply
from nexus.sim.env_sessions import store_episodes
from nexus.sim.host import SimHost
from nexus.wire import devices
from nexus.wire.dask_streams import send_promptly
from nexus.wire.engine_client import pack, unpack
from nexus.wire.engine_stream import LOOKUP_OP, StreamServer, listen_ssl
from nexus.wire.inputs import wire_json
from nexus.wire.messages import HEALTH_TOPIC, HEARTBEAT_S, Heartbeat, Rendezvous
from nexus.wire.signals import TOPIC as SIGNAL_TOPIC

if TYPE_CHECKING:
    from nexus.actor.host import ActorHost
    from nexus.config.service import ServiceConfig
    from nexus.engine.host import EngineHost
    from nexus.tracking.host import TrackerHost

logger = logging.getLogger("nexus.worker")

PLUGIN_NAME = "nexus"


def _errors_as_replies(fn):
    """A control-plane handler whose NexusErrors are answered as :func:`nexus.errors.to_reply` values."""
    async def handler(**msg: Any) -> Any:
        try:
            return await fn(**msg)
        except NexusError as e:
            return to_reply(e)

    handler.__name__ = fn.__name__
    return handler


def _run_nicer_than_the_nanny(by: int) -> None:
    """This process at ``by`` more niceness than its parent (the nanny): the same however often a plugin is set up."""
    want = min(19, os.getpriority(os.PRIO_PROCESS, os.getppid()) + by)
    os.setpriority(os.PRIO_PROCESS, 0, max(want, os.getpriority(os.PRIO_PROCESS, 0)))


class NexusWorkerPlugin(WorkerPlugin):
    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.worker = None
        self.actor: ActorHost | None = None
        self.sim = SimHost()
        self.engines: dict[str, EngineHost] = {}
        self.tracker: TrackerHost | None = None
        self.rendezvous_socket: socket.socket | None = None  # rank 0's, for its actor group's TCP store
        self.served_log: deque[tuple[str, str]] = deque(maxlen=200_000)  # (engine, request id) answered here
        self._lock = threading.Lock()
        self._beat: PeriodicCallback | None = None
        self._tick: asyncio.Future | None = None  # the environment sessions' periodic work
        self.stream = StreamServer(self._stream_call)  # engine calls past Dask's comm (nexus.wire.engine_stream)

    # -- Dask hooks --------------------------------------------------------------------------------
    def setup(self, worker) -> None:
        self.worker = worker
        send_promptly(worker.batched_stream)  # its stream to the scheduler: tasks done
        if worker.state.total_resources.get(ROLE_RESOURCES["tracker"]):
            _run_nicer_than_the_nanny(TRACKER_NICE)  # the tracker's own worker (``cluster.tracker_worker``)
        # the data path's callers (gateway, producers) unpickle what a handler raises; the control plane's get its
        # NexusErrors as replies (nexus.errors.to_reply)
        worker.handlers.update({"nexus_engine": self._in_worker(self._h_engine), "nexus_env": self._h_env,
                                LOOKUP_OP: self._h_engine_stream,
                                **{name: _errors_as_replies(fn) for name, fn in (
                                    ("nexus_engine_ctl", self._in_worker(self._h_engine_ctl)),
                                    ("nexus_tracker", self._h_tracker), ("nexus_io", self._h_io),
                                    ("nexus_env_ctl", self._h_env_ctl), ("nexus_sim_stop", self._h_sim_stop))}})
        self._beat = PeriodicCallback(self.beat, HEARTBEAT_S * 1000)
        self._beat.start()
        self.beat()

    def teardown(self, worker) -> None:
        if self._beat is not None:
            self._beat.stop()
        self.stream.close()

    def _in_worker(self, fn):
        """Run a handler as Dask runs actor methods: ``get_worker()`` works in it (and in the tasks and
        timers it starts), so the engine's monitoring signals reach the scheduler."""
        async def handler(**msg: Any) -> Any:
            token = _worker_cvar.set(self.worker)
            try:
                return await fn(**msg)
            finally:
                _worker_cvar.reset(token)

        handler.__name__ = fn.__name__
        return handler

    def beat(self) -> None:
        w = self.worker
        if w is None or w.status.name not in ("running", "paused"):
            return
        hb = Heartbeat(worker=str(w.name), address=w.address, t=time.time(), training=self.actor is not None,
                       slots=len(self.actor.slots) if self.actor is not None else 0,
                       tracker=self.tracker is not None, engines=[e.report() for e in self.engines.values()],
                       producers=self.sim.reports(), executing=[str(ts.key) for ts in w.state.executing],
                       sessions=self.sim.sessions.reports())
        w.log_event(HEALTH_TOPIC, hb.to_dict())
        busy = self._tick is not None and not self._tick.done()
        if not busy and (self.sim.sessions.sessions or self.sim.sessions.pending_metering):
            self._tick = asyncio.ensure_future(self._sessions_tick())

    # -- roles ---------------------------------------------------------------------------------------
    def host(self, role: str) -> Any:
        """This process's host of ``role`` ("plugin": the plugin itself, for tasks that place a role)."""
        if role == "plugin":
            return self
        if role == "sim":
            return self.sim
        if role == "actor":
            if self.actor is None:
                raise Unavailable(f"worker {self.worker.name if self.worker else '?'} hosts no actor rank (it "
                                  "restarted?): the control plane rebuilds the actor group")
            return self.actor
        raise ValueError(f"unknown role {role!r}")

    def _engine(self, engine: str) -> EngineHost:
        host = self.engines.get(engine)
        if host is None:  # stopped or never here: the caller asks for the tenant's route again
            raise Draining(f"inference engine {engine} is not hosted by worker {self.worker.name}")
        return host

    # -- handlers ------------------------------------------------------------------------------------
    async def _h_engine(self, engine: str, method: str, payload: Any) -> dict[str, Any]:
        call = unpack(payload)  # both ways packed whole (``nexus.wire.engine_client.pack``)
        out = await self._engine(engine).call(method, call.get("args", []), call.get("kwargs", {}))
        return {"result": pack(out)}

    async def _h_engine_stream(self) -> str | None:
        """The direct stream's address, on this worker's own host and with its own TLS (started on the first ask)."""
        address = self.worker.address
        if not address.startswith(("tcp://", "tls://")):
            return None  # in-process comms (tests): Dask's
        return await self.stream.start(get_address_host(address), listen_ssl(self.worker))

    async def _stream_call(self, engine: str, method: str, payload: bytes) -> Any:
        """An engine call that came over the stream: as ``_h_engine``, the reply pickled whole by the stream."""
        token = _worker_cvar.set(self.worker)
        try:
            call = unpack(payload)
            return await self._engine(engine).call(method, call.get("args", []), call.get("kwargs", {}))
        finally:
            _worker_cvar.reset(token)

    async def _h_engine_ctl(self, engine: str, action: str, **msg: Any) -> Any:
        out = await self._engine(engine).control(action, **msg)
        if action == "stop":
            self.engines.pop(engine, None)
        return out

    async def _h_tracker(self, calls: list[list[Any]]) -> list[Any]:
        if self.tracker is None:
            raise Draining(f"no tracker on worker {self.worker.name}")
        return await self.tracker.run(calls)

    async def _h_env(self, method: str, payload: dict[str, Any]) -> dict[str, Any]:
        """An environment session's reset / step (answered as JSON bytes), or an upload of episodes, from the gateway
        (pickled payload)."""
        loop = asyncio.get_running_loop()
        if method == "store_episodes":
            out = await loop.run_in_executor(self.sim.session_thread, lambda: store_episodes(**payload))
            return {"result": ToPickle(out)}
        if method not in ("reset", "step"):
            raise ValueError(f"unknown environment call {method!r}")
        sessions = self.sim.sessions
        s = sessions.sessions.get(str(payload.get("session")))
        inline = s is not None and s.inline  # a short call: no hand-off to the session thread and back
        if s is not None:
            s.pending += 1  # counted on the loop: the thread's idle check and the next call see it at once
        # the answer leaves as its final JSON (encoded where the call ran): one bytes frame through Dask instead
        # of a dozen serialized arrays, and nothing for the gateway to decode and re-encode
        try:
            if inline:
                out = wire_json(sessions.call(method, **payload))
            else:
                out = await loop.run_in_executor(self.sim.session_thread,
                                                 lambda: wire_json(sessions.call(method, **payload)))
        finally:
            if s is not None:
                s.pending -= 1
        return {"result": out}

    async def _h_env_ctl(self, action: str, **msg: Any) -> Any:
        """The control plane's session operations: ``open`` (build the envs) and ``close`` (plain values)."""
        sessions = self.sim.sessions
        if action not in ("open", "close"):
            raise ValueError(f"unknown environment session action {action!r}")
        fn = sessions.open if action == "open" else sessions.close
        return await asyncio.get_running_loop().run_in_executor(self.sim.session_thread, lambda: fn(**msg))

    async def _sessions_tick(self) -> None:
        """Close sessions idle past their timeout and report the sessions' simulator seconds to metering."""
        sessions, loop = self.sim.sessions, asyncio.get_running_loop()

        def tick() -> dict[str, float]:
            for s in sessions.expired(time.time()):
                logger.info("environment session %s of %s idle for %.0f s: closed", s.id, s.tenant, s.idle_s)
                sessions.close(s.id, s.tenant)
            return sessions.drain_metering()

        try:
            busy = await loop.run_in_executor(self.sim.session_thread, tick)
        except Exception as e:  # the next beat tries again
            logger.warning("environment sessions: %s", e)
            return
        t1 = time.time()
        for tenant, seconds in busy.items():
            self.worker.log_event(SIGNAL_TOPIC, {"kind": "env", "worker": self.worker.name, "tenant": tenant,
                                                 "busy_s": seconds, "t1": t1})

    async def _h_sim_stop(self, job: str) -> int:
        return self.sim.stop(job)

    async def _h_io(self, action: str, **msg: Any) -> Any:
        if action == "write_job_record":
            await asyncio.to_thread(TenantOutputDir(msg["output_dir"]).write_job, msg["record"])
            return True
        if action == "unmark_evaluation":
            return await asyncio.to_thread(unmark_evaluation, msg["output_dir"], msg["job"])
        raise ValueError(f"unknown io action {action!r}")


def current() -> NexusWorkerPlugin:
    """The calling worker's plugin (a task's worker); installs it on a worker started without the preload."""
    worker = get_worker()
    plugin = worker.plugins.get(PLUGIN_NAME)
    if plugin is None:
        sync(worker.loop, worker.plugin_add, NexusWorkerPlugin(), PLUGIN_NAME)
        plugin = worker.plugins[PLUGIN_NAME]
    return plugin


def host_for(role: str) -> Any:
    """The calling worker's host of ``role``: what ``nexus.control.tasks.TaskRef`` passes a role's task."""
    return current().host(role)


# -- tasks that place a role in this process (named by import path in nexus.control.tasks) ------------
# The role's module is imported here, when a worker first hosts the role: the others never load its stack.
def open_rendezvous(plugin: NexusWorkerPlugin) -> int:
    """Bind the socket that rank 0 of a new actor group serves its rendezvous on (this worker's own address,
    a free port; kept by the plugin for :func:`start_actor`) -> its port."""
    with plugin._lock:
        if plugin.actor is not None and plugin.actor.rendezvous is not None:  # its store serves on the socket
            raise RuntimeError(f"worker {plugin.worker.name} is rank {plugin.actor.rank} of a formed actor group: "
                               "a new group needs a fresh process")
        if plugin.rendezvous_socket is not None:  # a group that never formed
            plugin.rendezvous_socket.close()
        host = get_address_host(plugin.worker.address)
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        s.bind((host, 0))
        s.listen(128)  # connections wait in the backlog until rank 0's store serves them
        plugin.rendezvous_socket = s
        return int(plugin.rendezvous_socket.getsockname()[1])


def start_actor(plugin: NexusWorkerPlugin, config: ServiceConfig, rank: int = 0, world_size: int = 1,
                rendezvous: Rendezvous | None = None, local_rank: int = 0) -> str:
    """Host actor rank ``rank`` of ``world_size`` here (kept when this process already hosts it: its slots stay).

    With N ranks, every rank's task runs at the same time (the group forms when all have joined); rank 0
    serves ``rendezvous`` on the socket of :func:`open_rendezvous`. A process joins one group in its life."""
    with plugin._lock:
        actor = plugin.actor
        hosted = devices.installed().actor_host(config, rank, world_size, actor)
        if hosted is not None:  # a model of the devices hosts the rank (nexus.wire.devices): no torch here
            plugin.actor = hosted
            return plugin.worker.address
        from nexus.actor.host import ActorHost

        if actor is None or (actor.rank, actor.world_size, actor.rendezvous) != (rank, world_size, rendezvous):
            sock = plugin.rendezvous_socket if rank == 0 and rendezvous is not None else None
            if rank == 0 and rendezvous is not None and sock is None:
                raise RuntimeError("rank 0 has no rendezvous socket: run open_rendezvous on this worker first")
            plugin.actor = ActorHost(config, rank, world_size, rendezvous, local_rank,
                                     host=get_address_host(plugin.worker.address),
                                     listen_fd=sock.fileno() if sock is not None else None)
    return plugin.worker.address


def start_engine(plugin: NexusWorkerPlugin, engine_id: str, config: ServiceConfig) -> dict[str, Any]:
    """Host a new inference engine here (its backbone is built at its first sync)."""
    from nexus.engine.host import EngineHost

    worker = plugin.worker

    device = None
    if devices.held(worker) > 1:  # a worker holding several devices charges each engine to its own slot
        slot = int(engine_id.removeprefix("engine-").partition(".")[0])
        device = devices.slot_label(worker.name, devices.held(worker), slot)

    async def create() -> None:  # on the loop: the engine's asyncio objects belong to it
        plugin.engines[engine_id] = EngineHost(engine_id, config, plugin.served_log, device)

    sync(worker.loop, create)
    gc_tuning.pauses()  # counted from now on (the engine's stats)
    gc_tuning.apply(config.gc.freeze, config.gc.gen0_threshold)  # fewer, shorter GC pauses by the model
    return {"engine": engine_id, "address": worker.address, "worker": str(worker.name)}


def start_tracker(plugin: NexusWorkerPlugin, config: ServiceConfig) -> dict[str, Any]:
    from nexus.tracking.host import TrackerHost

    plugin.tracker = TrackerHost(config)
    return {"address": plugin.worker.address, "worker": str(plugin.worker.name)}


def slot_states(dask_worker) -> dict[str, dict[str, int]]:
    """Operator view of a worker's actor slots: per tenant its version, pending backward passes, the rank and
    group size, and the bytes of optimizer state this rank holds (measured from the optimizer's tensors)
    (``client.run(slot_states, workers=[...])``: tests, audits)."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    actor = plugin.actor if plugin is not None else None
    return {t: {"version": s.version, "pending_backward": s.pending_backward, "rank": s.rank,
                "world_size": s.world_size, "optimizer_bytes": s.optimizer_bytes()}
            for t, s in (actor.slots if actor is not None else {}).items()}


async def dask_setup(worker) -> None:
    """``dask worker --preload nexus.worker.plugin``."""
    root = logging.getLogger("nexus")
    if not root.handlers:  # Nexus's loggers write next to Dask's in the worker's log
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s - %(name)s - %(levelname)s - %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    await worker.plugin_add(NexusWorkerPlugin(), name=PLUGIN_NAME)


def producer_jobs(dask_worker) -> list[str]:
    """The jobs of the rollout producers running on a SIM worker now (``client.run(producer_jobs, ...)``: tests,
    audits)."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return [p.job for p in plugin.sim.producers.values()] if plugin is not None else []
