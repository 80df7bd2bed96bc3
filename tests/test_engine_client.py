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
