"""ActorGroup's rules for N ranks on a real (in-process) Dask cluster: rank 0's result when every rank
succeeds, the error when every rank raised the same one, and a broken group — to be rebuilt on fresh
processes of every rank — when the ranks' outcomes differ or one rank is still running after another failed."""

from __future__ import annotations

import asyncio
import time

import pytest
from distributed import LocalCluster

from nexus.control.health import actor_group as actors_module
from nexus.control.health.actor_group import ActorGroup
from nexus.control.health.actor_placement import local_ranks
from nexus.control.runtime import DaskRuntime
from nexus.control.tasks import TaskRef
from nexus.errors import RoleLost

OUTCOME = TaskRef("tests.test_actor_group_units:outcome")


def outcome(rank: int, plan: dict[int, str]) -> int:
    """What a rank does in the test: "ok" returns its rank, "fail" raises, "hang" sleeps."""
    what = plan.get(rank, "ok")
    if what == "fail":
        raise ValueError("the same error on every failing rank")
    if what == "hang":
        time.sleep(3)
    return rank


def test_local_ranks_count_ranks_per_host():
    assert local_ranks(["tcp://10.0.0.1:1", "tcp://10.0.0.1:2", "tcp://10.0.0.2:5", "tcp://10.0.0.1:3"]) == [0, 1, 0, 2]


def test_ranks_that_disagree_break_the_group(monkeypatch):
    monkeypatch.setattr(actors_module, "AGREE_S", 0.5)

    async def scenario() -> None:
        async with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, asynchronous=True,
                                protocol="tcp://", host="127.0.0.1", dashboard_address="127.0.0.1:0") as cluster:
            runtime = DaskRuntime(cluster.scheduler)
            group = ActorGroup(runtime, world_size=2)
            addresses = sorted(cluster.scheduler.workers)
            try:
                def ready() -> None:
                    group.set_ready(addresses, ["a0", "a1"])
                    group.stale = []

                async def call(plan: dict[int, str]):
                    return await group.run(OUTCOME, lambda r: (r, plan), key=f"t-{len(plan)}-{time.monotonic()}")

                ready()
                assert await call({}) == 0  # every rank succeeded: rank 0's result
                with pytest.raises(ValueError, match="same error"):
                    await call({0: "fail", 1: "fail"})  # the same error on all: an ordinary error
                assert group.ready and group.stale == []
                with pytest.raises(RoleLost, match="disagreed"):
                    await call({1: "fail"})  # one rank stepped, the other did not
                assert not group.ready and group.stale == addresses and "rank 1: ValueError" in group.broken_reason
                ready()
                with pytest.raises(RoleLost, match="rank 1: running"):
                    await call({0: "fail", 1: "hang"})  # a rank still inside the call: maybe in a collective
                assert not group.ready and group.stale == addresses
                ready()
                assert group.lost(addresses[1]) and group.stale == [addresses[0]]  # the survivor restarts too
            finally:
                await runtime.close()

    asyncio.run(scenario())
