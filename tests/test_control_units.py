"""The control plane's parts as plain objects, without a cluster: health state machine, tenant registry,
training-queue dispatcher, inference-engine pool (scaling, draining, rollback, routing), tracker link,
task references, and the output dir's write-once versions."""

from __future__ import annotations

import asyncio
import pickle
import sys

import pytest

from nexus.config.service import DispatchSettings, HealthSettings, ServiceConfig
from nexus.control.dispatch.dispatcher import Dispatcher
from nexus.control.dispatch.training_queue import TenantLimits, TrainingItem, TrainingQueue
from nexus.control.health.engine_pool import EnginePool, MemberState, PoolPolicy
from nexus.control.health.manager import HealthManager, RoleState
from nexus.control.jobs.state import JobState, JobStatus
from nexus.control.monitoring.tracking_link import TrackerLink
from nexus.control.tasks import TaskRef
from nexus.control.tenants.registry import TenantPhase, TenantRegistry, TenantState
from nexus.control.transitions import IllegalTransition
from nexus.errors import Draining, NotFound, RoleLost, SpecError, Unavailable
from nexus.features import TenantSchema
from nexus.spec import SFTJob, TenantSpec
from nexus.wire.messages import EngineEndpoint, Heartbeat, TenantSetup


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def run(coro):
    return asyncio.run(coro)


# -- health ----------------------------------------------------------------------------------------------
def test_health_timeouts_suspect_then_failed_and_heartbeat_recovers_suspect():
    clock = Clock()
    h = HealthManager(HealthSettings(suspect_after_s=5, fail_after_s=20), clock)
    h.register("engine/0", "engine", "tcp://a", "infer-0")
    h.ready("engine/0", "tcp://a", "infer-0")
    assert h.state("engine/0") == RoleState.HEALTHY
    clock.t += 6
    h.tick()
    assert h.state("engine/0") == RoleState.SUSPECT
    h.heartbeat("tcp://a")
    assert h.state("engine/0") == RoleState.HEALTHY
    clock.t += 21
    failed = h.tick()
    assert [r.role for r in failed] == ["engine/0"] and h.state("engine/0") == RoleState.FAILED
    h.heartbeat("tcp://a")  # a failed role is not revived by a late heartbeat: it must restart
    assert h.state("engine/0") == RoleState.FAILED


def test_health_worker_loss_restart_and_budget():
    clock = Clock()
    h = HealthManager(HealthSettings(restart_budget=2, budget_window_s=100), clock)
    h.register("actor/0", "actor", "tcp://a", "actor-0")
    h.ready("actor/0", "tcp://a", "actor-0")
    for _ in range(2):
        assert [r.role for r in h.worker_lost("tcp://a")] == ["actor/0"]
        assert h.state("actor/0") == RoleState.FAILED
        assert h.begin_restart("actor/0")
        assert h.state("actor/0") == RoleState.RESTARTING
        h.heartbeat("tcp://b")  # heartbeats do not end a restart: only a completed re-sync does
        assert h.state("actor/0") == RoleState.RESTARTING
        h.ready("actor/0", "tcp://a", "actor-0")
        assert h.state("actor/0") == RoleState.HEALTHY
        clock.t += 10
    h.worker_lost("tcp://a")
    assert not h.begin_restart("actor/0"), "third restart within the window is over budget"
    assert h.state("actor/0") == RoleState.FAILED and h.needs_global_restart() == ["actor/0"]
    clock.t += 100  # the window slides: the budget comes back
    assert h.begin_restart("actor/0")
    view = {r["role"]: r for r in h.views()}["actor/0"]
    assert view["restarts"] == 3 and view["state"] == "restarting"


def test_health_producers_are_progress_driven():
    clock = Clock()
    h = HealthManager(HealthSettings(producer_stall_s=30), clock)
    h.register("producer/j1", "rollout")
    h.progress("producer/j1", requests=5)
    assert h.state("producer/j1") == RoleState.HEALTHY
    h.error("producer/j1", "worker died", restarting=True)
    assert h.state("producer/j1") == RoleState.RESTARTING
    h.progress("producer/j1")
    assert h.state("producer/j1") == RoleState.HEALTHY
    clock.t += 31
    h.tick()
    assert h.state("producer/j1") == RoleState.SUSPECT  # never failed by a timeout alone


def test_health_settings_refuse_inverted_timeouts():
    with pytest.raises(ValueError, match="need 0 < suspect_after_s < fail_after_s"):
        HealthSettings(suspect_after_s=10, fail_after_s=5)


def test_heartbeat_message_round_trip_ignores_unknown_keys():
    hb = Heartbeat(worker="w", address="tcp://x", t=1.0, engines=[{"engine": "engine-0.1"}])
    assert Heartbeat.from_dict({**hb.to_dict(), "newer_field": 1}) == hb


# -- registry -----------------------------------------------------------------------------------------------
def _state(name: str) -> TenantState:
    return TenantState(spec=TenantSpec(name=name, env="maniskill/pushcube-state"),
                       schema=TenantSchema(proprio_dim=35, action_dim=4), output_dir=f"/tmp/{name}")


def test_registry_versions_never_go_back_and_unknown_tenant_is_not_found():
    reg = TenantRegistry()
    reg.add(_state("a"))
    assert reg.publish("a", 5) == 5
    assert reg.publish("a", 3) == 5, "a late report cannot move a tenant back"
    assert reg.versions() == {"a": 5}
    with pytest.raises(ValueError):
        reg.add(_state("a"))
    with pytest.raises(NotFound):
        reg.get("b")
    reg.get("a").phase = "deleting"
    with pytest.raises(NotFound):
        reg.get("a")
    setup = reg.find("a").setup()
    assert setup.version == 5 and setup.schema.proprio_dim == 35


def test_tenant_phases_move_only_forward_and_view_as_plain_strings():
    t = _state("a")
    assert t.phase == TenantPhase.CREATING == "creating"
    with pytest.raises(IllegalTransition, match="tenant 'a' cannot go from creating to deleting"):
        t.move(TenantPhase.DELETING)
    t.move(TenantPhase.READY)
    with pytest.raises(IllegalTransition):
        t.move(TenantPhase.CREATING)
    t.move(TenantPhase.DELETING)
    with pytest.raises(IllegalTransition, match="none, it is final"):
        t.move(TenantPhase.READY)
    assert type(t.view()["phase"]) is str and t.view()["phase"] == "deleting"


def test_job_states_follow_their_table_and_view_as_plain_strings():
    js = JobState(job_id="a-sft-1", tenant="a", spec=SFTJob(kind="sft", steps=1))
    assert js.state == "queued" and not js.terminal
    js.move(JobStatus.RUNNING)
    js.move(JobStatus.FAILED, "ValueError: bad")
    assert js.terminal and js.error == "ValueError: bad"
    with pytest.raises(IllegalTransition, match="job 'a-sft-1' cannot go from failed to done"):
        js.move(JobStatus.DONE)
    assert type(js.view()["state"]) is str and js.view()["state"] == "failed"
    waiting = JobState(job_id="a-sft-2", tenant="a", spec=SFTJob(kind="sft", steps=1))
    waiting.move(JobStatus.CANCELLED, "cancelled by request")  # cancelled before admission
    assert waiting.terminal


# -- dispatcher ----------------------------------------------------------------------------------------------
def _queue(**tenants: int) -> TrainingQueue:
    q = TrainingQueue()
    for name, cap in tenants.items():
        q.set_limits(name, TenantLimits(max_inflight=cap))
    return q


def test_dispatcher_respects_concurrency_and_frees_slots():
    async def main():
        q = _queue(a=3)
        running, peak = 0, 0

        async def execute(item):
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.01)
            running -= 1
            return {"version": 1, "metrics": {}}

        d = Dispatcher(q, execute, lambda: {"a": 0}, DispatchSettings(max_concurrent_updates=2))
        futs = []
        for k in range(3):
            await d.reserve("a")
            futs.append(asyncio.ensure_future(d.submit(TrainingItem("a", "sft", 0, work=k, job="j"))))
        await asyncio.gather(*futs)
        assert peak == 2
        assert q.counters["a"].inflight == 0

    run(main())


def test_dispatcher_requeues_items_of_a_lost_actor_without_losing_the_slot():
    async def main():
        q = _queue(a=1)
        calls = []

        async def execute(item):
            calls.append(item.item_id)
            if len(calls) == 1:
                raise RoleLost("actor rank lost")
            return {"version": 7, "metrics": {}}

        up = {"actor": True}

        async def execute_and_lose(item):
            if not calls:
                up["actor"] = False  # the rank dies under the item
            return await execute(item)

        d = Dispatcher(q, execute_and_lose, lambda: {"a": 0}, available=lambda: up["actor"])
        await d.reserve("a")
        fut = asyncio.ensure_future(d.submit(TrainingItem("a", "rl", 0, job="j")))
        await asyncio.sleep(0.01)
        assert len(calls) == 1 and q.counters["a"].queued == 1 and q.counters["a"].inflight == 1
        d.pump()
        await asyncio.sleep(0.01)
        assert len(calls) == 1, "nothing runs while the actor group is down"
        up["actor"] = True
        d.pump()
        assert (await fut)["version"] == 7
        assert calls[0] == calls[1] and d.retried_lost == 1
        assert q.counters["a"].inflight == 0

    run(main())


def test_dispatcher_retries_errors_then_fails_and_returns_the_slot():
    async def main():
        q = _queue(a=1)
        n = 0

        async def execute(item):
            nonlocal n
            n += 1
            raise ValueError("bad batch")

        d = Dispatcher(q, execute, lambda: {"a": 0}, DispatchSettings(item_attempts=2))
        await d.reserve("a")
        with pytest.raises(ValueError, match="bad batch"):
            await d.submit(TrainingItem("a", "sft", 0, job="j"))
        assert n == 2 and q.counters["a"].inflight == 0
        assert q.reserve("a"), "the slot came back"

    run(main())


def test_dispatcher_cancel_takes_a_queued_item_out():
    async def main():
        q = _queue(a=2)
        gate = asyncio.Event()

        async def execute(item):
            await gate.wait()
            return {"version": 1, "metrics": {}}

        d = Dispatcher(q, execute, lambda: {"a": 0})
        await d.reserve("a")
        first = asyncio.ensure_future(d.submit(TrainingItem("a", "sft", 0, job="j")))
        await d.reserve("a")
        second = asyncio.ensure_future(d.submit(TrainingItem("a", "sft", 0, job="j")))
        await asyncio.sleep(0.01)
        assert q.counters["a"].running == 1 and q.counters["a"].queued == 1
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        assert q.counters["a"].queued == 0 and q.counters["a"].inflight == 1
        first.cancel()  # a running item finishes; its slot returns when it does
        await asyncio.gather(first, return_exceptions=True)
        assert q.counters["a"].running == 1
        gate.set()
        await asyncio.sleep(0.01)
        assert q.counters["a"].inflight == 0

    run(main())


def test_dispatcher_drops_stale_items_and_frees_their_slots():
    async def main():
        q = TrainingQueue()
        q.set_limits("a", TenantLimits(max_inflight=2, max_staleness=1))

        async def execute(item):
            return {"version": 10, "metrics": {}}

        up = {"actor": False}
        d = Dispatcher(q, execute, lambda: {"a": 10}, available=lambda: up["actor"])
        await d.reserve("a")
        fut = asyncio.ensure_future(d.submit(TrainingItem("a", "rl", 3, job="j")))
        await asyncio.sleep(0)
        up["actor"] = True
        d.pump()
        res = await fut
        assert res == {"dropped": True, "lag": 7} and q.counters["a"].dropped_stale == 1
        assert q.counters["a"].inflight == 0

    run(main())


def test_dispatcher_reads_its_knobs_from_the_dispatch_settings_and_a_scheduler_changes_its_concurrency():
    d = Dispatcher(TrainingQueue(), None, dict, DispatchSettings(max_concurrent_updates=3, item_attempts=4))
    assert (d.max_concurrent, d.item_attempts) == (3, 4)
    d.apply(ServiceConfig(root=".", dispatch={"max_concurrent_updates": 2}))
    assert (d.max_concurrent, d.item_attempts) == (2, 4)
    with pytest.raises(ValueError):
        DispatchSettings(max_concurrent_updates=0)


# -- engine pool -------------------------------------------------------------------------------------------
class Engines:
    """In-process stand-ins for engines hosted by workers (what the pool's ops act on)."""

    def __init__(self, workers: int = 2) -> None:
        self.workers = [f"tcp://infer-{i}" for i in range(workers)]
        self.held: dict[str, dict[str, int]] = {}  # engine -> tenant -> version
        self.pins: dict[str, list[tuple[str, int]]] = {}
        self.state: dict[str, str] = {}
        self.fail_start_after: int | None = None
        self.started = 0
        self.log: list[tuple[str, str]] = []
        self.sync_delay = 0.0

    def place(self, prefer_worker, load, waited_s):
        if not self.workers:
            return None
        return min(self.workers, key=lambda w: (load.get(w, 0), w))

    async def start(self, slot, epoch, address):
        if self.fail_start_after is not None and self.started >= self.fail_start_after:
            raise Unavailable("no INFER worker left")
        self.started += 1
        ep = EngineEndpoint(f"engine-{slot}.{epoch}", address)
        self.held[ep.engine], self.pins[ep.engine], self.state[ep.engine] = {}, [], "syncing"
        self.log.append(("start", ep.engine))
        return ep, address.rpartition("/")[2]

    async def sync(self, ep, tenants, pins):
        await asyncio.sleep(self.sync_delay)
        for t in tenants:
            self.held[ep.engine][t.name] = max(self.held[ep.engine].get(t.name, -1), t.version)
        for tenant, version, _, count in pins:
            self.pins[ep.engine] += [(tenant, version)] * count
        self.log.append(("sync", ep.engine))

    async def drain(self, ep, timeout):
        self.state[ep.engine] = "draining"
        self.log.append(("drain", ep.engine))

    async def stop(self, ep):
        self.state[ep.engine] = "stopped"
        self.log.append(("stop", ep.engine))

    async def unregister(self, ep, tenant):
        self.held[ep.engine].pop(tenant, None)

    async def pin(self, ep, tenant, version, output_dir):
        self.pins[ep.engine].append((tenant, version))

    async def unpin(self, ep, tenant, version):
        self.pins[ep.engine].remove((tenant, version))

    async def set_batching(self, ep, max_wait_s, max_batch):
        self.log.append(("batching", ep.engine, max_wait_s, max_batch))


def _setups(*names: str, version: int = 3) -> list[TenantSetup]:
    return [TenantSetup(n, {}, {}, f"/tmp/{n}", version) for n in names]


def test_pool_scale_up_syncs_before_serving_and_rebalances():
    async def main():
        ops = Engines()
        tenants = _setups("a", "b", "c", "d")
        pool = EnginePool(ops, lambda: tenants, engines=1)
        await pool.ensure()
        for t in tenants:
            await pool.add_tenant(t)
        await pool.pin("a", 2, "/tmp/a")
        assert {pool.route(t.name).engine for t in tenants} == {"engine-0.1"}
        ops.sync_delay = 0.05
        scaling = asyncio.ensure_future(pool.scale(2))
        await asyncio.sleep(0.02)
        new = pool.members[1]
        assert new.state == MemberState.SYNCING
        assert all(pool.route(t.name).engine == "engine-0.1" for t in tenants), "no route to an engine still syncing"
        assert new.endpoint in pool.push_targets(), "a syncing engine already receives new versions"
        view = await scaling
        assert ops.held["engine-1.1"] == {t.name: 3 for t in tenants} and ops.pins["engine-1.1"] == [("a", 2)]
        assert ops.log.index(("sync", "engine-1.1")) > ops.log.index(("start", "engine-1.1"))
        per_engine = {}
        for t in tenants:
            per_engine.setdefault(pool.route(t.name).engine, []).append(t.name)
        assert sorted(len(v) for v in per_engine.values()) == [2, 2]
        assert view["target"] == 2 and [e["state"] for e in view["engines"]] == ["serving", "serving"]

    run(main())


def test_pool_scale_down_drains_after_rerouting_and_stops():
    async def main():
        ops = Engines()
        tenants = _setups("a", "b")
        pool = EnginePool(ops, lambda: tenants, engines=2)
        await pool.ensure()
        routed_during_drain = {}

        async def drain(ep, timeout):
            routed_during_drain.update({t.name: pool.route(t.name).engine for t in tenants})
            ops.log.append(("drain", ep.engine))

        ops.drain = drain
        await pool.scale(1)
        assert set(routed_during_drain.values()) == {"engine-0.1"}, "tenants left the engine before it drained"
        assert ops.log[-2:] == [("drain", "engine-1.1"), ("stop", "engine-1.1")]
        assert list(pool.members) == [0] and pool.target == 1
        with pytest.raises(SpecError):
            await pool.scale(0)

    run(main())


def test_pool_partial_scale_up_rolls_back():
    async def main():
        ops = Engines(workers=3)
        tenants = _setups("a")
        pool = EnginePool(ops, lambda: tenants, engines=1)
        await pool.ensure()
        ops.fail_start_after = 2  # the second new engine cannot start
        with pytest.raises(Unavailable, match="rolled back to 1"):
            await pool.scale(3)
        assert list(pool.members) == [0] and pool.target == 1
        assert ops.state["engine-1.1"] == "stopped"
        assert pool.route("a").engine == "engine-0.1"
        assert "engine/1" not in pool.health.roles and "engine/2" not in pool.health.roles

    run(main())


def test_pool_scale_operations_are_serialized():
    async def main():
        ops = Engines(workers=3)
        pool = EnginePool(ops, lambda: [], engines=1)
        await pool.ensure()
        ops.sync_delay = 0.02
        order = []

        async def scale(n):
            v = await pool.scale(n)
            order.append((n, len(v["engines"])))

        await asyncio.gather(scale(3), scale(2))
        assert order == [(3, 3), (2, 2)], "the second scale ran only after the first had finished"

    run(main())


def test_pool_replaces_a_lost_engine_in_place_and_reroutes_meanwhile():
    async def main():
        ops = Engines()
        tenants = _setups("a", "b")
        h = HealthManager(HealthSettings(restart_budget=1))
        pool = EnginePool(ops, lambda: tenants, engines=2, policy=PoolPolicy(route_wait_s=1), health=h)
        await pool.ensure()
        lost_addr = pool.members[1].endpoint.address
        h.worker_lost(lost_addr)
        pool.member_lost(lost_addr)
        assert {pool.route(t.name).engine for t in tenants} == {"engine-0.1"}, "survivor serves everyone"
        await pool.ensure()
        assert pool.members[1].endpoint.engine == "engine-1.2" and pool.members[1].state == MemberState.SERVING
        assert h.state("engine/1") == RoleState.HEALTHY and h.get("engine/1").restarts == 1
        h.worker_lost(pool.members[1].endpoint.address)
        pool.member_lost(pool.members[1].endpoint.address)
        await pool.ensure()  # budget of 1 spent: stays failed
        assert pool.members.get(1) is None and h.state("engine/1") == RoleState.FAILED

    run(main())


def test_pool_route_waits_for_an_engine_and_times_out():
    async def main():
        ops = Engines()
        pool = EnginePool(ops, lambda: _setups("a"), engines=1)
        with pytest.raises(Unavailable):
            await pool.wait_route("a", timeout=0.05)
        waiter = asyncio.ensure_future(pool.wait_route("a", timeout=5))
        await asyncio.sleep(0.01)
        await pool.ensure()
        assert (await waiter).engine == "engine-0.1"

    run(main())


def test_pool_catches_up_engines_that_missed_a_version():
    async def main():
        ops = Engines()
        tenants = _setups("a", version=3)
        pool = EnginePool(ops, lambda: tenants, engines=2)
        await pool.ensure()
        await pool.on_published(TenantSetup("a", {}, {}, "/tmp/a", 4), pushed_to=("engine-0.1",))
        assert ops.held["engine-1.1"]["a"] == 4 and ops.held["engine-0.1"]["a"] == 3

    run(main())


def test_pool_applies_a_schedulers_batching_to_serving_engines_once_it_changes():
    async def main():
        ops = Engines()
        pool = EnginePool(ops, lambda: [], engines=2, batching=(0.005, 8))
        await pool.ensure()
        await pool.apply(ServiceConfig(root=".", infer_max_wait_s=0.005, infer_max_batch=8))
        assert not [e for e in ops.log if e[0] == "batching"], "unchanged T and B are not pushed"
        await pool.apply(ServiceConfig(root=".", infer_max_wait_s=0.02, infer_max_batch=4))
        assert [e for e in ops.log if e[0] == "batching"] == [("batching", "engine-0.1", 0.02, 4),
                                                              ("batching", "engine-1.1", 0.02, 4)]
        assert pool.batching == (0.02, 4)

    run(main())


# -- tracker link ------------------------------------------------------------------------------------------------
def test_tracker_link_resends_after_loss_and_reopens_runs_first():
    async def main():
        sent: list[tuple[str, list]] = []
        fail = {"on": False}

        async def send(address, calls):
            if fail["on"]:
                raise OSError("tracker's worker died")
            sent.append((address, [c[0] for c in calls]))
            return [f"run-{c[1]['job_id']}" if c[0] == "start_run" else None for c in calls]

        link = TrackerLink(send)
        link.start()
        link.attach("tcp://t1")
        link.start_run("j1", "a", "rl", {})
        assert await link.flush(60)
        assert link.runs == {"j1": "run-j1"}
        fail["on"] = True
        link.log_metrics("j1", {"loss": 1.0, "note": "x"}, 1)
        await asyncio.sleep(0.05)
        assert link.pending == 1
        link.lost()
        fail["on"] = False
        link.attach("tcp://t2")
        assert await link.flush(60)
        assert sent[-1] == ("tcp://t2", ["reopen", "log_metrics"])
        await link.close()

    run(main())


# -- task references and durable versions -------------------------------------------------------------------------
def test_task_ref_pickles_by_path_and_resolves_on_call():
    ref = TaskRef("nexus.wire.messages:job_number")
    clone = pickle.loads(pickle.dumps(ref))
    assert clone == ref and clone("a-rl-12") == 12 and ref.__name__ == "job_number"
    with pytest.raises(ValueError):
        TaskRef("no-colon")


def test_control_modules_import_no_service_module():
    import subprocess

    code = ("import sys, nexus.control.plugin, nexus.control.master; "
            "roles = ('nexus.actor', 'nexus.engine', 'nexus.sim', 'nexus.tracking', 'nexus.worker'); "
            "print(sorted(m for m in sys.modules if m.startswith(roles) or m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_weights_are_written_once_and_versions_listed_once(tmp_path):
    from nexus.data.output_dir import TenantOutputDir

    out = TenantOutputDir(tmp_path / "t")
    out.create({"name": "t"}, {})
    digest = out.write_weights(1, b"v1-bytes")
    out.write_weights(1, b"v1-bytes")  # a retried write of the same bytes is fine
    with pytest.raises(FileExistsError, match="never rewritten"):
        out.write_weights(1, b"other")
    assert out.weights_path(1).read_bytes() == b"v1-bytes"
    out.add_version(1, "sft:x")
    out.add_version(1, "sft:again")
    versions = out.read()["versions"]
    assert len(versions) == 1 and versions[0]["sha256"] == digest
    out.write_weights(3, b"v3")  # written just before a crash, never listed
    assert out.highest_version() == 3


def test_request_check_names_the_problem():
    import numpy as np

    from nexus.engine.request_check import check_request
    from nexus.features import CameraSpec, Observation

    schema = TenantSchema(proprio_dim=3, action_dim=2, cameras=(CameraSpec("cam", 8, 8),))
    good = Observation(state=np.zeros(3, np.float32), images={"cam": np.zeros((8, 8, 3), np.uint8)})
    check_request(good, schema)
    bad = [(Observation(state=np.zeros(4, np.float32), images=good.images), "shape"),
           (Observation(state=np.array([np.nan, 0, 0]), images=good.images), "NaN"),
           (Observation(state=np.zeros(3), images={}), "cameras"),
           (Observation(state=np.zeros(3), images={"cam": np.zeros((8, 8, 3), np.float32)}), "dtype"),
           (Observation(state=np.array(["a", "b", "c"]), images=good.images), "dtype"),
           ({"state": [0, 0, 0]}, "Observation")]
    for obs, msg in bad:
        with pytest.raises(SpecError, match=msg):
            check_request(obs, schema)


def test_draining_is_a_retryable_unavailable():
    assert issubclass(Draining, Unavailable) and issubclass(RoleLost, Unavailable)
