"""The actor's weight push to an engine whose worker has just died: reported, not raised, and given up after
the short push window (the actor is shared: a dead engine must not stall every tenant's updates); an engine call's
payload and reply on the wire (small ones as pickled bytes, large ones out of band)."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
from distributed import Client, LocalCluster

from nexus.wire.engine_client import CONNECT_TIMEOUT_S, PUSH_CONNECT_TIMEOUT_S, EngineSet
from nexus.wire.messages import EngineEndpoint


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster, Client(cluster) as c:
        yield c


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_a_push_to_a_dead_engine_is_reported_after_the_push_window(client):
    assert PUSH_CONNECT_TIMEOUT_S < CONNECT_TIMEOUT_S
    dead = EngineEndpoint(engine="engine-0.1", address=f"tcp://127.0.0.1:{_closed_port()}")
    pushes = EngineSet(client, [dead])
    assert pushes.load_weights("t", 7, b"weights").result(timeout=30) == 7
    assert pushes.pushed_to == []
    [err] = pushes.errors
    assert err.startswith("engine-0.1: OSError") and f"after {PUSH_CONNECT_TIMEOUT_S:g} s" in err, err


def test_an_engine_calls_payload_and_reply_cross_a_tcp_comm_packed_whole():
    """``call_engine`` over a real TCP comm to a Dask server answering as the worker plugin does: a small call (a
    producer's observations) travels as pickled bytes, one that is large (an image batch) as Dask's own pickling,
    its arrays out of band; both arrive equal, and so do the replies."""
    import asyncio

    import numpy as np

    from nexus.wire.engine_client import INLINE_MAX_BYTES, call_engine, pack, unpack
    from tests.dask_servers import loopback_servers

    seen: list[type] = []

    async def nexus_engine(engine: str, method: str, payload) -> dict:
        seen.append(type(payload))
        call = unpack(payload)
        return {"result": pack({"engine": engine, "method": method, **call})}

    small = [{"state": np.arange(9, dtype=np.float32), "instruction": "lift"}] * 4
    large = [{"image": np.full((128, 128, 3), i, np.uint8)} for i in range(4)]
    assert 4 * 128 * 128 * 3 > INLINE_MAX_BYTES

    async def main() -> list:
        async with loopback_servers({"nexus_engine": nexus_engine}) as (pool, [server]):
            ep = EngineEndpoint(engine="engine-0.0", address=server.address)
            return [await call_engine(SimpleNamespace(rpc=pool), ep, "predict_batch", "t", obs, version=3)
                    for obs in (small, large)]

    got_small, got_large = asyncio.run(main())
    assert seen == [bytes, list]  # as sent: bytes Dask passes through, a 1-list it unpickled
    assert isinstance(pack(small), bytes) and not isinstance(pack(large), bytes)
    for got, obs in ((got_small, small), (got_large, large)):
        assert got["engine"] == "engine-0.0" and got["method"] == "predict_batch" and got["kwargs"] == {"version": 3}
        tenant, sent = got["args"]
        assert tenant == "t" and len(sent) == 4
        for a, b in zip(sent, obs, strict=True):
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a if k != "instruction")


def test_small_engine_calls_take_the_workers_direct_stream_and_large_ones_or_streamless_workers_dask():
    """``call_engine(stream=True)`` over real sockets: a worker that offers the stream gets the small call there (the
    Dask handler never sees it), a large one over Dask; replies and raised errors come back as they were; a worker
    without the stream's handler is called over Dask; a stream whose worker went away fails retryably and the next call
    opens a new one."""
    import asyncio

    import numpy as np

    from nexus.errors import Draining
    from nexus.wire.engine_client import call_engine, pack, retryable, unpack
    from nexus.wire.engine_stream import LOOKUP_OP, StreamServer, streams
    from tests.dask_servers import loopback_servers

    over: list[str] = []

    async def answer(engine: str, method: str, call: dict, path: str):
        over.append(path)
        if method == "refuse":
            raise Draining(f"{engine} is draining")
        return {"engine": engine, "method": method, **call}

    async def nexus_engine(engine: str, method: str, payload) -> dict:  # as the worker plugin's Dask handler
        return {"result": pack(await answer(engine, method, unpack(payload), "dask"))}

    async def stream_call(engine: str, method: str, payload: bytes):  # as the plugin's stream handler
        return await answer(engine, method, unpack(payload), "stream")

    server = StreamServer(stream_call)

    async def lookup() -> str:
        return await server.start("127.0.0.1")

    small = {"state": np.arange(9, dtype=np.float32)}
    large = {"image": np.zeros((160, 160, 3), np.uint8)}  # past INLINE_MAX_BYTES

    async def main() -> None:
        async with loopback_servers({"nexus_engine": nexus_engine, LOOKUP_OP: lookup},
                                    {"nexus_engine": nexus_engine}) as (pool, [with_stream, without]):
            caller = SimpleNamespace(rpc=pool)
            ep = EngineEndpoint(engine="engine-0.0", address=with_stream.address)
            got = await call_engine(caller, ep, "predict_many", [small], stream=True, timeout=10)
            assert over == ["stream"] and got["args"][0][0]["state"].tolist() == list(range(9))
            got = await call_engine(caller, ep, "predict_many", [large], stream=True)
            assert over[-1] == "dask" and got["args"][0][0]["image"].shape == (160, 160, 3)
            with pytest.raises(Draining, match="engine-0.0 is draining"):
                await call_engine(caller, ep, "refuse", stream=True)
            assert over[-1] == "stream"
            old = EngineEndpoint(engine="engine-1.0", address=without.address)
            assert (await call_engine(caller, old, "versions", stream=True))["engine"] == "engine-1.0"
            assert over[-1] == "dask"
            conn = await streams().get(caller, with_stream.address, 5)
            server.close()  # the worker's stream goes away with a call in flight (its listener and connection)
            conn.writer.transport.abort()
            await asyncio.sleep(0.05)
            with pytest.raises(OSError) as e:
                await conn.call("engine-0.0", "predict_many", b"")
            assert retryable(e.value)
            server.address = None  # a restarted listener: the next call looks it up again and reconnects
            got = await call_engine(caller, ep, "predict_many", [small], stream=True)
            assert over[-1] == "stream" and got["engine"] == "engine-0.0"
            streams().close()
            server.close()

    asyncio.run(main())


def test_the_engine_stream_under_tls_takes_only_callers_with_the_clusters_certificate(tmp_path):
    """With the cluster's TLS the stream listens with the worker's Dask context: a caller holding the service's
    certificate gets its answer, a plain TCP caller gets none."""
    import asyncio

    from distributed import Security

    from nexus.deploy.tls import ensure_certificates
    from nexus.wire.engine_client import pack
    from nexus.wire.engine_stream import StreamClosed, StreamConn, StreamServer, listen_ssl

    f = ensure_certificates(tmp_path)
    sec = Security(require_encryption=True, tls_ca_file=str(f.ca), tls_client_cert=str(f.cert),
                   tls_client_key=str(f.key), tls_worker_cert=str(f.cert), tls_worker_key=str(f.key))

    async def echo(engine: str, method: str, payload: bytes):
        return [engine, method, payload]

    async def main() -> None:
        server = StreamServer(echo)
        address = await server.start("127.0.0.1", listen_ssl(SimpleNamespace(security=sec)))
        try:
            conn = await StreamConn.open(address, sec.get_connection_args("client")["ssl_context"])
            assert await conn.call("engine-0.0", "versions", pack({}), timeout=10) == ["engine-0.0", "versions",
                                                                                     pack({})]
            conn.close()
            plain = await StreamConn.open(address)
            with pytest.raises((StreamClosed, TimeoutError)):
                await plain.call("engine-0.0", "versions", pack({}), timeout=5)
            plain.close()
        finally:
            server.close()

    asyncio.run(main())
