"""A direct stream from callers to an engine's worker for the data path's small calls (a gateway's predicts).

Over Dask's comm, a lone predict's round trip from the gateway to the engine and back cost ~1.8 ms beside a
15 ms forward (``experiments/serving``): Dask's framing and serialization walk, Tornado's stream, the worker's
generic handler dispatch, on both sides. This stream is one asyncio connection per (caller's loop, worker), kept
open and shared by every call to that worker: a frame is a call id, a length and the call pickled whole (as
:func:`nexus.wire.engine_client.pack` already sends it inside Dask's message), answered by a frame with the same
id, so calls run concurrently and replies come back in any order.

Security stays the cluster's: the worker listens on the host of its own Dask address, and with TLS
(``ServiceConfig.tls``) both ends use the contexts of the cluster's ``distributed.Security`` (mutual TLS, the same
CA), so exactly the processes that may call the worker over Dask may call it here. A worker that offers no stream
(an older one, an in-process test cluster) is called over Dask as before. Large payloads (weights, image batches
past ``INLINE_MAX_BYTES``) stay on Dask's comm, which sends their arrays out of band.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import struct
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("nexus.wire.engine_stream")

HEADER = struct.Struct("<QQ")  # call id, body length
OK, ERROR = 0, 1
LOOKUP_OP = "nexus_engine_stream"  # the worker's handler: the stream's address, or None

# engine, method, the call's pickled payload -> the reply (raised exceptions travel back pickled)
Handle = Callable[[str, str, bytes], Awaitable[Any]]


def _error_frame(call_id: int, e: BaseException) -> bytes:
    try:
        body = pickle.dumps((ERROR, e), protocol=5)
    except Exception:  # an exception that does not pickle: its text
        body = pickle.dumps((ERROR, RuntimeError(f"{type(e).__name__}: {e}")), protocol=5)
    return HEADER.pack(call_id, len(body)) + body


class StreamServer:
    """The worker's side: one listener, each connection's calls run as they arrive, answered when done."""

    def __init__(self, handle: Handle) -> None:
        self.handle = handle
        self.server: asyncio.base_events.Server | None = None
        self.address: str | None = None  # host:port
        self._starting: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str, ssl: Any = None) -> str:
        """Listen on ``host`` (once; later calls return the address)."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.address is None:
                self.server = await asyncio.start_server(self._serve, host, 0, ssl=ssl)
                port = self.server.sockets[0].getsockname()[1]
                self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return self.address

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                call_id, n = HEADER.unpack(await reader.readexactly(HEADER.size))
                body = await reader.readexactly(n)
                task = asyncio.get_running_loop().create_task(self._one(call_id, body, writer))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the caller went away: its calls' replies have nowhere to go
        finally:
            writer.close()

    async def _one(self, call_id: int, body: bytes, writer: asyncio.StreamWriter) -> None:
        try:
            engine, method, payload = pickle.loads(body)
            out = pickle.dumps((OK, await self.handle(engine, method, payload)), protocol=5)
            frame = HEADER.pack(call_id, len(out)) + out
        except Exception as e:
            frame = _error_frame(call_id, e)
        if not writer.is_closing():
            writer.write(frame)  # one write per frame: frames of concurrent calls never interleave


class StreamClosed(ConnectionError):
    """The stream to an engine's worker closed with calls in flight (retryable: an ``OSError``)."""


class StreamConn:
    """The caller's side of one stream: calls in flight by id, one reader task settling them."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._next = 0
        self._pending: dict[int, asyncio.Future] = {}
        self.closed = False
        self._reading = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, address: str, ssl: Any = None, timeout: float = 5.0) -> StreamConn:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port), ssl=ssl), timeout)
        return cls(reader, writer)

    async def call(self, engine: str, method: str, payload: bytes, timeout: float | None = None) -> Any:
        if self.closed:
            raise StreamClosed("the stream to the engine's worker is closed")
        self._next += 1
        call_id = self._next
        fut = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        body = pickle.dumps((engine, method, payload), protocol=5)
        self.writer.write(HEADER.pack(call_id, len(body)) + body)
        try:
            return await (asyncio.wait_for(fut, timeout) if timeout else fut)
        finally:
            self._pending.pop(call_id, None)

    async def _read(self) -> None:
        error: BaseException = StreamClosed("the engine's worker closed the stream")
        try:
            while True:
                call_id, n = HEADER.unpack(await self.reader.readexactly(HEADER.size))
                status, value = pickle.loads(await self.reader.readexactly(n))
                fut = self._pending.pop(call_id, None)
                if fut is None or fut.done():
                    continue  # its caller gave up (timeout)
                if status == OK:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            error = StreamClosed(f"the stream to the engine's worker closed ({type(e).__name__}: {e})")
        except Exception as e:  # a frame that does not unpickle: the stream is unusable
            logger.warning("engine stream failed: %r", e)
            error = StreamClosed(f"the stream to the engine's worker failed ({type(e).__name__}: {e})")
        finally:
            self.close(error)

    def close(self, error: BaseException | None = None) -> None:
        self.closed = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error or StreamClosed("the stream was closed"))
        self._pending.clear()
        self.writer.close()


class Streams:
    """A caller's streams by worker address (None: that worker offers none; Dask's comm serves it)."""

    def __init__(self) -> None:
        self._conns: dict[str, StreamConn | None] = {}
        self._opening: dict[str, asyncio.Future] = {}

    async def get(self, server: Any, worker: str, timeout: float) -> StreamConn | None:
        conn = self._conns.get(worker, False)
        if conn is None or (conn is not False and not conn.closed):
            return conn
        opening = self._opening.get(worker)
        if opening is None:  # one lookup and connect at a time per worker; concurrent callers share it
            opening = self._opening[worker] = asyncio.ensure_future(self._open(server, worker, timeout))
            opening.add_done_callback(lambda _: self._opening.pop(worker, None))
        return await asyncio.shield(opening)

    async def _open(self, server: Any, worker: str, timeout: float) -> StreamConn | None:
        try:
            address = await asyncio.wait_for(server.rpc(worker).nexus_engine_stream(), timeout)
        except (OSError, TimeoutError):
            raise  # the worker is unreachable: the caller re-routes
        except Exception as e:  # no such handler (an older worker): Dask's comm
            logger.info("worker %s offers no engine stream (%s): calls go over Dask", worker, e)
            address = None
        conn = None
        if address is not None:
            conn = await StreamConn.open(address, client_ssl(server), timeout)
        self._conns[worker] = conn
        return conn

    def close(self) -> None:
        for conn in self._conns.values():
            if conn is not None:
                conn.close()
        self._conns.clear()


_STREAMS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Streams] = weakref.WeakKeyDictionary()


def streams() -> Streams:
    """This event loop's streams (a stream's transport belongs to the loop that opened it)."""
    loop = asyncio.get_running_loop()
    s = _STREAMS.get(loop)
    if s is None:
        s = _STREAMS[loop] = Streams()
    return s


def _ssl(security: Any, role: str, listen: bool) -> Any:
    if security is None:
        return None
    args = security.get_listen_args(role) if listen else security.get_connection_args(role)
    return args.get("ssl_context")


def client_ssl(server: Any) -> Any:
    """The TLS context a Dask ``Client`` or ``Worker`` connects with (None without TLS)."""
    from distributed import Client

    return _ssl(getattr(server, "security", None), "client" if isinstance(server, Client) else "worker", False)


def listen_ssl(worker: Any) -> Any:
    """The TLS context the worker's own Dask listener uses (None without TLS)."""
    return _ssl(getattr(worker, "security", None), "worker", True)
