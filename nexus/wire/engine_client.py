"""Callers' side of the inference engines: rollout producers, the actor's weight pushes, the API.

* :class:`EngineClient` sends a tenant's requests to the engine that serves the tenant. When that
  engine is draining (``Draining``) or unreachable (its worker died), it asks the control plane for
  the tenant's route again (``nexus_route``: waits until some engine serves) and resends. A request
  is resent only when no engine accepted it, so every request is answered exactly once.
* :class:`EngineSet` pushes a new version to every engine of the pool at once and tolerates engines
  that are gone (the pool re-syncs a replacement from the durable weights).
* :class:`EngineHandle` calls one given engine (stats, tests).

``server`` is a Dask ``Worker`` (inside tasks) or ``Client`` (the API): both give ``rpc``,
``scheduler`` and ``loop``. Calls are made from a thread other than the loop's and return
``concurrent.futures.Future`` objects (``.result()``), the interface Dask actor calls had.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from nexus.errors import Unavailable
from nexus.wire.engine_stream import streams
from nexus.wire.messages import EngineEndpoint

logger = logging.getLogger("nexus.wire.engine_client")

DATA_OP = "nexus_engine"
# an engine call's payload or reply up to this size goes as pickled bytes (below)
INLINE_MAX_BYTES = 64 * 1024


def _loop(server) -> asyncio.AbstractEventLoop:
    loop = server.loop
    return getattr(loop, "asyncio_loop", loop)


def on_loop(server, coro) -> Future:
    """Run ``coro`` on a Dask worker's or client's event loop from another thread."""
    return asyncio.run_coroutine_threadsafe(coro, _loop(server))


def retryable(e: BaseException) -> bool:
    """Comm failures and ``Unavailable`` refusals (draining, restarting) mean: try another engine."""
    return isinstance(e, OSError | TimeoutError | Unavailable)


CONNECT_TIMEOUT_S = 5.0  # a dead engine's worker refuses at once; Dask would retry connecting for 30 s
# A weight push holds the actor, which every tenant shares: a push to an engine that has just died must not stall
# everyone's updates for the whole retry window. A missed push is reported and caught up (EnginePool.on_published).
PUSH_CONNECT_TIMEOUT_S = 1.0


def pack(obj: Any) -> Any:
    """An engine call's payload or its reply as Dask sends it, pickled whole (``to_serialize`` would walk a list of
    dicts holding arrays item by item, a header per array: ~10x the CPU for 16 replies). Small ones as pickled bytes,
    which Dask passes through as they are: a round trip ~1/3 less CPU on each side than Dask pickling them itself
    (``ToPickle``: its own frames and headers); large ones (images, weights) as ``ToPickle`` of a 1-list, whose
    arrays Dask sends out of band rather than copied into one bytes object (2x the CPU at 10 MB)."""
    from distributed.protocol.serialize import ToPickle

    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    if len(head) + sum(b.raw().nbytes for b in buffers) > INLINE_MAX_BYTES:
        return ToPickle([obj])
    return pickle.dumps(obj, protocol=5) if buffers else head


def unpack(msg: Any) -> Any:
    """What :func:`pack` sent: bytes to unpickle, or the 1-list Dask has unpickled."""
    return pickle.loads(msg) if isinstance(msg, bytes) else msg[0]


async def call_engine(server, ep: EngineEndpoint, method: str, *args: Any, timeout: float | None = None,
                      connect_timeout: float = CONNECT_TIMEOUT_S, stream: bool = False, **kwargs: Any) -> Any:
    """``method(*args, **kwargs)`` on engine ``ep``. ``stream``: a small call goes over the direct stream to the
    engine's worker where it offers one (:mod:`nexus.wire.engine_stream`), else over Dask's comm."""
    from distributed.core import send_recv

    payload = pack({"args": list(args), "kwargs": kwargs})
    if stream and isinstance(payload, bytes):
        conn = await streams().get(server, ep.address, connect_timeout)
        if conn is not None:
            return await conn.call(ep.engine, method, payload, timeout)
    pool = server.rpc
    extra = {k: v for k, v in (("serializers", pool.serializers), ("deserializers", pool.deserializers))
             if v is not None}
    comm = await pool.connect(ep.address, timeout=connect_timeout)
    try:  # packed as the engine's reply is (``NexusWorkerPlugin._h_engine``)
        coro = send_recv(comm=comm, op=DATA_OP, engine=ep.engine, method=method, payload=payload, **extra)
        reply = await (asyncio.wait_for(coro, timeout) if timeout else coro)
    finally:
        pool.reuse(ep.address, comm)
    return unpack(reply["result"])


class EngineClient:
    def __init__(self, server, routes: dict[str, EngineEndpoint] | None = None, request_timeout_s: float = 120.0,
                 route_timeout_s: float = 600.0, on_answer: Callable[[], None] | None = None,
                 route_ttl_s: float = 2.0) -> None:
        self.server = server
        now = time.monotonic()
        self._routes: dict[str, tuple[EngineEndpoint, float]] = {t: (ep, now) for t, ep in (routes or {}).items()}
        self.route_ttl_s = route_ttl_s  # routes are asked again this often: a re-routed tenant follows
        self.request_timeout_s = request_timeout_s
        self.route_timeout_s = route_timeout_s
        self.on_answer = on_answer
        self.resent = 0  # requests sent again after an engine refused or was lost

    def predict(self, tenant: str, obs: Any, version: int | None = None, deterministic: bool = False,
                job: str | None = None) -> Future:
        return self.call("predict", tenant, obs, version, deterministic, job, request_id=uuid.uuid4().hex)

    async def apredict_batch(self, tenant: str, observations: list, version: int | None = None,
                             deterministic: bool = False) -> list[Any]:
        """Actions for several observations of one tenant as one request, for callers on the server's own
        event loop (the gateway): one output (action, logprob, value, version) per observation."""
        reply = await self._call("predict_batch", tenant, (observations, version, deterministic),
                                 {"request_id": uuid.uuid4().hex})
        return reply["outputs"]

    def call(self, method: str, tenant: str, *args: Any, **kwargs: Any) -> Future:
        """Call ``method(tenant, *args, **kwargs)`` on the tenant's engine."""
        return on_loop(self.server, self._call(method, tenant, args, kwargs))

    def predict_batch(self, tenant: str, observations: list, *args: Any, **kwargs: Any) -> Future:
        """Several observations of one tenant as one request (a rollout producer's envs)."""
        return self.call("predict_batch", tenant, observations, *args, request_id=uuid.uuid4().hex, **kwargs)

    def call_for(self, tenant: str, method: str, *args: Any, **kwargs: Any) -> Future:
        """Call ``method(*args, **kwargs)`` (no tenant argument) on the engine that serves ``tenant``."""
        return on_loop(self.server, self._call(method, tenant, args, kwargs, pass_tenant=False))

    def __getattr__(self, method: str) -> Callable[..., Future]:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda tenant, *args, **kwargs: self.call(method, tenant, *args, **kwargs)

    async def endpoint(self, tenant: str) -> EngineEndpoint:
        """The engine serving ``tenant`` (asked again after ``route_ttl_s``)."""
        cached = self._routes.get(tenant)
        if cached is None or time.monotonic() - cached[1] > self.route_ttl_s:
            return await self._route(tenant, None, None)
        return cached[0]

    async def reroute(self, tenant: str, stale: EngineEndpoint, error: BaseException) -> EngineEndpoint:
        """``stale`` refused or lost a request of ``tenant``: the tenant's route, asked again."""
        self.resent += 1
        logger.info("engine %s refused or lost a request of %s (%s); re-routing", stale.engine, tenant, error)
        return await self._route(tenant, stale.engine, f"{type(error).__name__}: {error}")

    async def _call(self, method: str, tenant: str, args: tuple, kwargs: dict, pass_tenant: bool = True) -> Any:
        deadline = time.monotonic() + self.route_timeout_s
        ep = await self.endpoint(tenant)
        while True:
            try:
                lead = (tenant,) if pass_tenant else ()
                out = await call_engine(self.server, ep, method, *lead, *args, timeout=self.request_timeout_s,
                                        **kwargs)
                if self.on_answer is not None:
                    self.on_answer()
                return out
            except Exception as e:
                if not retryable(e) or time.monotonic() > deadline:
                    raise
                ep = await self.reroute(tenant, ep, e)

    async def _route(self, tenant: str, stale: str | None, error: str | None) -> EngineEndpoint:
        info = await self.server.scheduler.nexus_route(tenant=tenant, stale=stale, error=error,
                                                       timeout=self.route_timeout_s)
        ep = EngineEndpoint.from_dict(info)
        self._routes[tenant] = (ep, time.monotonic())
        return ep


class EngineSet:
    """Weight pushes from the actor to every engine of the pool (those that fail are reported, not raised)."""

    def __init__(self, server, endpoints: tuple[EngineEndpoint, ...] | list[EngineEndpoint],
                 timeout_s: float = 60.0) -> None:
        self.server = server
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self.pushed_to: list[str] = []
        self.errors: list[str] = []

    def load_weights(self, tenant: str, version: int, weights: bytes) -> Future:
        return on_loop(self.server, self._push_all(tenant, version, weights))

    async def _push_all(self, tenant: str, version: int, weights: bytes) -> int:
        results = await asyncio.gather(*(call_engine(self.server, ep, "load_weights", tenant, version, weights,
                                                     timeout=self.timeout_s, connect_timeout=PUSH_CONNECT_TIMEOUT_S)
                                         for ep in self.endpoints),
                                       return_exceptions=True)
        for ep, r in zip(self.endpoints, results, strict=True):
            if isinstance(r, BaseException):
                self.errors.append(f"{ep.engine}: {type(r).__name__}: {r}")
            elif r is not None:  # None: the engine is still syncing and will be caught up
                self.pushed_to.append(ep.engine)
        return version


class EngineHandle:
    """Calls to one given engine: ``handle.engine_stats().result()``."""

    def __init__(self, server, endpoint: EngineEndpoint) -> None:
        self.server = server
        self.endpoint = endpoint

    def __getattr__(self, method: str) -> Callable[..., Future]:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: on_loop(self.server, call_engine(self.server, self.endpoint, method, *args,
                                                                         **kwargs))
