"""The actor's weight push to an engine whose worker has just died: reported, not raised, and given up after
the short push window (the actor is shared: a dead engine must not stall every tenant's updates)."""

from __future__ import annotations

import socket

import pytest
from distributed import Client, LocalCluster

from nexus.engine_client import CONNECT_TIMEOUT_S, PUSH_CONNECT_TIMEOUT_S, EngineSet
from nexus.messages import EngineEndpoint


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
