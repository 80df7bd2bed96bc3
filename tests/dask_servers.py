"""Dask comm servers on loopback for tests of what crosses a worker's RPC (an engine call, an engine's notices)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from distributed.core import ConnectionPool, Server


@asynccontextmanager
async def loopback_servers(*handlers: dict[str, Callable]) -> AsyncIterator[tuple[ConnectionPool, list[Server]]]:
    """One Dask server on 127.0.0.1 (a free port) per handler table, and a connection pool to call them with: the
    pool closed and the servers stopped on the way out, also when the test fails."""
    servers = [Server(h) for h in handlers]
    pool = None
    try:
        for s in servers:
            await s.listen("tcp://127.0.0.1:0")
        pool = await ConnectionPool(limit=4)
        yield pool, servers
    finally:
        if pool is not None:
            await pool.close()
        for s in servers:
            s.stop()
