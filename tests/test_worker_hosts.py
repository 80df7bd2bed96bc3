"""Role hosts on a real Dask worker: a task named with a role gets the calling worker's host of that role as
its first argument (``TaskRef(path, role)``), the host's state outlives the task, and a role the worker does
not host is refused with the reason."""

from __future__ import annotations

import pytest
from distributed import Client, LocalCluster

from nexus.control.runtime import DaskRuntime
from nexus.control.tasks import TaskRef
from nexus.errors import Draining, NotFound, Unavailable
from nexus.sim.host import SimHost
from nexus.worker.plugin import NexusWorkerPlugin


def host_kind(host, tag: str) -> tuple[str, int, str]:
    """What a task sees: its host's class, the host object's identity, and its own argument."""
    return type(host).__name__, id(host), tag


def remember(sim: SimHost, key: str) -> list[str]:
    sim.producers.setdefault(key, None)  # state kept by the worker's host, not by the task
    return sorted(sim.producers)


@pytest.fixture(scope="module")
def client():
    # in-process (inproc comms, no sockets): the worker is a real Dask worker in this process
    with LocalCluster(n_workers=1, processes=False, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as c:
        yield c


def test_a_role_task_gets_its_workers_host(client):
    sim = client.submit(TaskRef("tests.test_worker_hosts:host_kind", "sim"), "a", pure=False).result()
    again = client.submit(TaskRef("tests.test_worker_hosts:host_kind", "sim"), "b", pure=False).result()
    assert sim[0] == "SimHost" and sim[2] == "a" and again[1] == sim[1]  # one host per worker process
    plugin = client.submit(TaskRef("tests.test_worker_hosts:host_kind", "plugin"), "c", pure=False).result()
    assert plugin[0] == NexusWorkerPlugin.__name__
    plain = client.submit(TaskRef("nexus.wire.messages:job_number"), "t-rl-7", pure=False).result()
    assert plain == 7  # no role: the arguments only


def test_a_hosts_state_outlives_its_tasks(client):
    ref = TaskRef("tests.test_worker_hosts:remember", "sim")
    client.submit(ref, "first", pure=False).result()
    assert client.submit(ref, "second", pure=False).result() == ["first", "second"]


def test_a_role_the_worker_does_not_host_is_refused(client):
    fut = client.submit(TaskRef("tests.test_worker_hosts:host_kind", "actor"), "x", pure=False)
    with pytest.raises(Unavailable, match="hosts no actor rank"):
        fut.result()
    with pytest.raises(ValueError, match="unknown role"):
        client.submit(TaskRef("tests.test_worker_hosts:host_kind", "gpu"), "x", pure=False).result()  # type: ignore[arg-type]


async def control_calls(dask_scheduler, address: str) -> list[tuple[str, str]]:
    """The control plane's calls to a worker's handlers, made where it makes them (the scheduler's RPC)."""
    runtime, out = DaskRuntime(dask_scheduler), []
    for handler, msg in (("nexus_env_ctl", {"action": "close", "session": "s-gone", "tenant": "t"}),
                         ("nexus_engine_ctl", {"engine": "engine-9.0", "action": "stop"}),
                         ("nexus_env_ctl", {"action": "explode"})):
        try:
            await runtime.call(address, handler, **msg)
        except Exception as e:
            out.append((type(e).__name__, str(e)))
    return out


def test_the_control_plane_gets_a_workers_refusals_as_their_own_class():
    # over TCP, as between processes: the scheduler does not unpickle what a worker raises (inproc would pass the
    # exception object itself)
    with LocalCluster(n_workers=1, processes=False, protocol="tcp://", host="127.0.0.1", threads_per_worker=1,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as c:
        c.submit(TaskRef("tests.test_worker_hosts:host_kind", "sim"), "install", pure=False).result()
        (address,) = c.scheduler_info()["workers"]
        (gone, engine, unknown) = c.run_on_scheduler(control_calls, address=address)
    assert gone[0] == NotFound.__name__ and "no environment session 's-gone' of tenant 't'" in gone[1]
    assert engine[0] == Draining.__name__ and "engine-9.0 is not hosted" in engine[1]
    assert unknown[0] == "Exception" and "unknown environment session action" in unknown[1]  # not ours: as before
