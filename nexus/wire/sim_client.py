"""Callers' side of the simulator workers' environment sessions (the gateway): one call to the ``SIM`` worker
hosting a session, worker-to-worker (a reset or step answers observations: they never pass through the
scheduler). ``server`` is a Dask ``Client`` or ``Worker`` (anything with ``rpc``)."""

from __future__ import annotations

import asyncio
from typing import Any

from nexus.wire.engine_client import CONNECT_TIMEOUT_S

SIM_OP = "nexus_env"


async def call_sim(server, address: str, method: str, timeout: float | None = 120.0, plain: bool = False,
                   **payload: Any) -> Any:
    """``method`` (reset, step, store_episodes) on the simulator worker at ``address``; the worker's
    :class:`nexus.errors.NexusError` refusals arrive as such. ``plain``: the payload is msgpack-ready (strings,
    numbers, lists, bytes) and goes as it is, not pickled (a step's ~0.3 ms less CPU on each side)."""
    from distributed.core import send_recv
    from distributed.protocol.serialize import ToPickle

    pool = server.rpc
    extra = {k: v for k, v in (("serializers", pool.serializers), ("deserializers", pool.deserializers))
             if v is not None}
    comm = await pool.connect(address, timeout=CONNECT_TIMEOUT_S)
    try:
        coro = send_recv(comm=comm, op=SIM_OP, method=method, payload=payload if plain else ToPickle(payload),
                         **extra)
        reply = await (asyncio.wait_for(coro, timeout) if timeout else coro)
    finally:
        pool.reuse(address, comm)
    return reply["result"]
