"""Schedulers (``schedulers/*.toml``: named overlays of the service's settings), isolated admission and the
accounting, without a cluster."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from nexus.config import scheduling
from nexus.config.service import Scheduler, ServiceConfig, ServiceLimits
from nexus.control.dispatch.admission import Admission
from nexus.control.dispatch.training_queue import TenantLimits, TrainingItem, TrainingQueue
from nexus.control.monitoring.state import MonitoringState, Span, accounting
from nexus.control.tenants.lifecycle import with_admission_defaults
from nexus.errors import SpecError
from nexus.spec import TenantSpec

REPO = Path(__file__).resolve().parents[1]


def test_every_catalog_file_validates_and_the_default_is_one_of_them():
    files = sorted((REPO / "schedulers").glob("*.toml"))
    assert {"fifo", "priority", "isolated"} <= {f.stem for f in files}
    for f in files:
        sched = Scheduler.load(f.stem)
        assert sched.name == f.stem and sched.description
        assert sched == Scheduler.load(str(f))  # by name or by path: the same scheduler
    assert scheduling.DEFAULT in scheduling.names()
    assert Scheduler.load("isolated").value("dispatch.isolated")
    assert not Scheduler.load(scheduling.DEFAULT).value("dispatch.isolated")
    assert Scheduler.load("fifo").value("dispatch.queue_order") == "fifo"
    assert Scheduler.load("priority").value("dispatch.queue_order") == "priority"


def test_service_config_fills_unset_fields_from_the_scheduler_and_explicit_fields_win(tmp_path):
    c = ServiceConfig(root=str(tmp_path), scheduler="gather")
    assert c.dispatch.queue_order == "priority" and c.infer_max_batch == Scheduler.load("gather").value(
        "infer_max_batch") == 32
    c = ServiceConfig(root=str(tmp_path), scheduler="gather", infer_max_batch=16,
                      dispatch={"item_attempts": 3, "eval_fanout": 4}, datapath={"sync_mode": "eager"})
    assert c.infer_max_batch == 16 and c.dispatch.eval_fanout == 4 and c.datapath.sync_mode == "eager"
    assert c.dispatch.item_attempts == 3 and c.dispatch.queue_order == "priority"  # unset: from the file
    assert c.infer_max_wait_s == 0.25  # unset: from the file
    again = ServiceConfig.restore(c.model_dump())  # workers: no file read, same values
    assert again == c
    assert ServiceConfig(root=str(tmp_path)).scheduler == scheduling.DEFAULT
    # a section given as a model counts its explicitly set fields only; the scheduler fills the rest
    c = ServiceConfig(root=str(tmp_path), scheduler="fifo", datapath=ServiceConfig(root=".").datapath.model_copy(
        update={"sync_every": 3}))
    assert c.datapath.sync_every == 3 and c.dispatch.queue_order == "fifo"


def test_a_restored_config_does_not_read_its_scheduler_file_again(tmp_path):
    own = tmp_path / "own.toml"
    own.write_text('description = "mine"\ninfer_max_batch = 3\n[dispatch]\nqueue_order = "fifo"\n')
    c = ServiceConfig(root=str(tmp_path), scheduler=str(own))
    assert (c.infer_max_batch, c.dispatch.queue_order, c.scheduler) == (3, "fifo", str(own))
    own.unlink()  # a worker on another host has no such file
    assert ServiceConfig.restore(c.model_dump()) == c
    with pytest.raises(ValidationError, match="cannot be read"):
        ServiceConfig.model_validate(c.model_dump())


@pytest.mark.parametrize("text, field", [
    ('[dispatch]\nqueue_order = "lifo"\n', "dispatch.queue_order"),
    ("infer_max_batch = 0\n", "infer_max_batch"),
    ("infer_max_wait_s = -1.0\n", "infer_max_wait_s"),
    ("[dispatch]\neval_fanout = 0\n", "dispatch.eval_fanout"),
    ('[datapath]\nsync_mode = "sometimes"\n', "datapath.sync_mode"),
    ("[dispatch]\nmax_concurent_updates = 2\n", "dispatch.max_concurent_updates"),  # a typo is refused
    ('queue_order = "fifo"\n', "queue_order"),  # a setting outside its section is refused, not ignored
    ('[dispatch]\nisolated = "maybe"\n', "dispatch.isolated"),
    ('name = "other"\n', "name"),
    ('root = "/elsewhere"\n', "root"),
    ('scheduler = "fifo"\n', "scheduler"),
])
def test_a_bad_scheduler_file_is_refused_naming_file_and_field(tmp_path, text, field):
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(SpecError) as e:
        Scheduler.load(str(bad))
    assert str(bad) in str(e.value) and repr(field) in str(e.value)
    with pytest.raises(ValidationError, match=f"{bad}.*'{field}'"):  # the service refuses to start with it
        ServiceConfig(root=str(tmp_path), scheduler=str(bad))


def test_a_moved_key_is_refused_naming_its_new_home(tmp_path):
    bad = tmp_path / "old.toml"
    bad.write_text('[datapath]\nsync_policy = "eager"\n')
    with pytest.raises(SpecError, match="datapath.sync_policy is now datapath.sync_mode"):
        Scheduler.load(str(bad))
    with pytest.raises(ValidationError, match="dispatch.default_max_inflight is now limits.default_max_inflight"):
        ServiceConfig(root=str(tmp_path), dispatch={"default_max_inflight": 2})


def test_unreadable_unknown_or_malformed_schedulers_are_refused(tmp_path):
    with pytest.raises(SpecError, match="unknown scheduler 'nope'.*fifo"):
        Scheduler.load("nope")
    with pytest.raises(SpecError, match="cannot be read"):
        Scheduler.load(str(tmp_path / "missing.toml"))
    (tmp_path / "broken.toml").write_text("infer_max_batch = \n")
    with pytest.raises(SpecError, match="broken.toml: not valid TOML"):
        Scheduler.load(str(tmp_path / "broken.toml"))


def test_a_catalog_root_with_a_scheduler_over_the_inflight_cap_is_refused(tmp_path, monkeypatch):
    (tmp_path / "schedulers").mkdir()
    shutil.copy(REPO / "schedulers" / "fifo.toml", tmp_path / "schedulers" / "wide.toml")
    text = (tmp_path / "schedulers" / "wide.toml").read_text().replace("default_max_inflight = 2",
                                                                      "default_max_inflight = 6")
    (tmp_path / "schedulers" / "wide.toml").write_text(text)
    monkeypatch.setenv("NEXUS_CATALOG_ROOT", str(tmp_path))
    assert scheduling.names() == ["wide"]
    assert ServiceConfig(root=str(tmp_path), scheduler="wide").limits.default_max_inflight == 6
    with pytest.raises(ValidationError, match="default_max_inflight 6 exceeds limits.max_inflight 4"):
        ServiceConfig(root=str(tmp_path), scheduler="wide", limits={"max_inflight": 4})


def test_every_catalog_scheduler_sets_the_same_keys_so_a_switch_between_them_is_complete():
    def keys(d: dict, prefix: str = "") -> set[str]:
        return {k for key, v in d.items()
                for k in (keys(v, f"{prefix}{key}.") if isinstance(v, dict) else {prefix + key})}

    sets = {n: keys(Scheduler.load(n).settings) for n in scheduling.names()}
    first = sets[scheduling.DEFAULT]
    assert {"dispatch.queue_order", "infer_max_batch", "datapath.sync_mode", "routing"} <= first
    assert all(s == first for s in sets.values()), {n: s ^ first for n, s in sets.items() if s != first}


def test_with_scheduler_applies_its_settings_over_the_running_ones_and_keeps_the_rest(tmp_path):
    c = ServiceConfig(root=str(tmp_path), scheduler="priority", dispatch={"item_attempts": 3})
    sched = Scheduler.load("isolated").with_settings({"infer_max_batch": 5, "datapath": {"sync_mode": "eager",
                                                       "sync_every": 2}, "dispatch": {"max_concurrent_updates": 2}})
    new = c.with_scheduler(sched)
    assert new.scheduler == "isolated" and new.dispatch.isolated and new.dispatch.queue_order == "fifo"
    assert (new.infer_max_batch, new.datapath.sync_mode, new.datapath.sync_every) == (5, "eager", 2)
    assert new.dispatch.max_concurrent_updates == 2
    assert new.dispatch.item_attempts == 3 and new.root == c.root  # not the scheduler's: unchanged
    assert c.scheduler == "priority" and c.dispatch.max_concurrent_updates == 1  # the original is unchanged
    assert c.with_scheduler(Scheduler.load("priority")) == c  # back: every scheduler key again
    with pytest.raises(SpecError, match="default_max_inflight 6 exceeds limits.max_inflight 4"):
        ServiceConfig(root=str(tmp_path), limits={"max_inflight": 4}).with_scheduler(
            sched.with_settings({"limits": {"default_max_inflight": 6}}))
    with pytest.raises(SpecError, match="'dispatch.queue_order'"):
        sched.with_settings({"dispatch": {"queue_order": "lifo"}})


def test_scheduler_parts_apply_their_settings(tmp_path):
    q = TrainingQueue("priority")
    q.set_limits("low", TenantLimits(max_inflight=5, priority=0))
    q.set_limits("high", TenantLimits(max_inflight=5, priority=5))
    for name in ("low", "high"):
        q.reserve(name)
        q.put(TrainingItem(tenant=name, kind="sft", policy_version=0))
    base = ServiceConfig(root=str(tmp_path))
    q.apply(base.with_scheduler(Scheduler.load("fifo")))
    assert q.order == "fifo" and [q.pop({})[0].tenant for _ in range(2)] == ["low", "high"]  # re-ranked
    adm = Admission(False)
    adm.apply(base.with_scheduler(Scheduler.load("isolated")))
    assert adm.view()["isolated"]


def test_tenants_that_leave_admission_unset_get_the_service_defaults_and_old_specs_keep_theirs():
    limits = ServiceLimits(default_max_inflight=3, default_max_staleness=7)
    spec = with_admission_defaults(TenantSpec(name="a", env="maniskill/pushcube-state"), limits)
    assert (spec.max_inflight, spec.max_staleness) == (3, 7)
    capped = ServiceLimits(default_max_inflight=3, max_inflight=2)  # a tenant_limits override of the cap
    assert with_admission_defaults(TenantSpec(name="a", env="maniskill/pushcube-state"), capped).max_inflight == 2
    old = TenantSpec(name="a", env="maniskill/pushcube-state", max_inflight=1, max_staleness=0)
    assert with_admission_defaults(old, limits) == old
    shipped = Scheduler.load(scheduling.DEFAULT)  # the values these TenantSpec fields defaulted to before
    assert (shipped.value("limits.default_max_inflight"), shipped.value("limits.default_max_staleness")) == (2, 128)
    assert (ServiceLimits().default_max_inflight, ServiceLimits().default_max_staleness) == (2, 128)


def test_queue_order_fifo_ignores_priorities_priority_honours_them():
    def run(order: str) -> list[str]:
        q = TrainingQueue(order)
        q.set_limits("low", TenantLimits(max_inflight=5, priority=0))
        q.set_limits("high", TenantLimits(max_inflight=5, priority=5))
        for name in ("low", "high", "low", "high"):
            q.reserve(name)
            q.put(TrainingItem(tenant=name, kind="sft", policy_version=0))
        return [q.pop({})[0].tenant for _ in range(4)]

    assert run("fifo") == ["low", "high", "low", "high"]
    assert run("priority") == ["high", "high", "low", "low"]
    with pytest.raises(ValueError, match="queue order"):
        TrainingQueue("lifo")


def test_isolated_admission_runs_tenants_one_after_another_in_submission_order():
    async def scenario(isolated: bool) -> tuple[list[str], int]:
        adm = Admission(isolated)
        log: list[str] = []
        live: set[str] = set()
        most = 0

        async def job(jid: str, tenant: str, work: float) -> None:
            nonlocal most
            await adm.acquire(jid, tenant)
            log.append(jid)
            live.add(tenant)
            most = max(most, len(live))
            await asyncio.sleep(work)
            live.discard(tenant)
            adm.release(tenant)

        tasks = []
        for jid, tenant in (("a1", "a"), ("b1", "b"), ("a2", "a"), ("c1", "c")):
            tasks.append(asyncio.create_task(job(jid, tenant, 0.01)))
            await asyncio.sleep(0)  # submitted in this order
        await asyncio.gather(*tasks)
        return log, most

    log, most = asyncio.run(scenario(True))
    assert log == ["a1", "b1", "a2", "c1"] and most == 1  # FIFO; a2 waited for b1 although a ran before
    log, most = asyncio.run(scenario(False))
    assert most == 3  # shared: every tenant's job at once


def test_isolated_admission_lets_a_tenants_own_jobs_overlap_and_a_cancelled_waiter_leaves_the_line():
    async def scenario() -> None:
        adm = Admission(True)
        await adm.acquire("a1", "a")
        own = asyncio.create_task(adm.acquire("a2", "a"))  # the tenant's eval beside its training job
        await asyncio.sleep(0)
        assert own.done()
        other = asyncio.create_task(adm.acquire("b1", "b"))
        third = asyncio.create_task(adm.acquire("c1", "c"))
        await asyncio.sleep(0)
        assert not other.done() and adm.view()["waiting"] == ["b1", "c1"]
        other.cancel()
        await asyncio.gather(other, return_exceptions=True)
        assert adm.view()["waiting"] == ["c1"]
        adm.release("a")
        adm.release("a")
        await asyncio.wait_for(third, 1)  # c1 no longer waits behind the cancelled b1
        assert adm.view()["running_tenants"] == ["c"]

    asyncio.run(scenario())


def _spans() -> list[Span]:
    return [Span("actor", "actor-0", "a", 0.0, 2.0, "rl"), Span("actor", "actor-0", "b", 1.5, 3.0, "sft"),
            Span("simulator", "sim-0", "a", 0.0, 4.0, "rl", sim_s=3.0, wait_s=0.5),
            Span("simulator", "sim-1", "b", 6.0, 14.0, "rl", sim_s=4.0, wait_s=2.0),  # cut by the window
            Span("inference", "infer-0", "a+b", 1.0, 1.5, "group")]


def test_accounting_busy_never_exceeds_wall_and_utilizations_are_fractions():
    acc = accounting(_spans(), {"actor": ["actor-0"], "inference": ["infer-0", "infer-1"],
                                "simulator": ["sim-0", "sim-1"]}, 0.0, 10.0)
    assert acc["wall_s"] == 10.0
    a, i, s = (acc["services"][k] for k in ("actor", "inference", "simulator"))
    assert a["busy_s"] == pytest.approx(3.0)  # overlapping spans of one slot count once
    assert i["slots"] == 2 and i["device_s"] == 20.0 and i["busy_per_slot_s"]["infer-1"] == 0.0
    assert s["busy_per_slot_s"] == pytest.approx({"sim-0": 4.0, "sim-1": 4.0})
    assert s["split_s"]["stepping"] == pytest.approx(3.0 + 2.0) and s["split_s"]["waiting_for_actions"] == \
        pytest.approx(0.5 + 1.0)  # the cut span counts half of its split
    assert sum(s["split_s"].values()) == pytest.approx(s["busy_s"])
    for row in acc["services"].values():
        assert all(b <= acc["wall_s"] + 1e-9 for b in row["busy_per_slot_s"].values())
        assert 0.0 <= row["utilization"] <= 1.0
        assert all(0.0 <= u <= 1.0 for u in row["utilization_per_slot"].values())
    assert acc["device_s"] == pytest.approx(10 + 20 + 20)
    assert 0.0 <= acc["utilization"] <= 1.0


def test_accounting_counts_unlisted_workers_and_empty_windows():
    acc = accounting(_spans(), {"actor": []}, 0.0, 10.0)
    assert acc["services"]["actor"]["slots"] == 1  # seen in the spans: allocated
    named = accounting(_spans(), {"actor": ["a0"]}, 0.0, 10.0, aliases={"actor-0": "a0"})["services"]["actor"]
    assert named["slots"] == 1 and named["busy_per_slot_s"] == pytest.approx({"a0": 3.0})  # an address, a name
    empty = accounting(_spans(), {"actor": ["actor-0"]}, 20.0, 20.0)
    assert empty["services"]["actor"]["utilization"] == 0.0 and empty["device_s"] == 0.0
    mon = MonitoringState()
    mon.ingest({"kind": "rollout", "worker": "sim-0", "tenant": "a", "t0": mon.t_start, "t1": mon.t_start + 1,
                "sim_s": 0.6, "action_wait_s": 0.3})
    got = mon.accounting({"simulator": ["sim-0"]}, mon.t_start, mon.t_start + 2)["services"]["simulator"]
    assert got["utilization"] == pytest.approx(0.5)
    assert got["split_s"] == pytest.approx({"stepping": 0.6, "waiting_for_actions": 0.3, "other": 0.1})


def test_running_totals_match_the_span_accounting_for_sequential_slots():
    mon = MonitoringState()
    mon.t_start -= 10  # spans of the last 10 s
    t = mon.t_start
    for k in range(3):
        mon.ingest({"kind": "update", "worker": "actor-0", "tenant": "a", "t0": t + k, "t1": t + k + 0.5})
    mon.ingest({"kind": "inference", "worker": "infer-0", "busy_s": 0.2, "by_tenant": {"a": 0.2},
                "spans": [(t, t + 0.1, ["a"]), (t + 1, t + 1.1, ["a", "b"])], "sizes": [4, 8]})
    slots = {"actor": ["actor-0"], "inference": ["infer-0"], "simulator": ["sim-0"]}
    tot = mon.totals(slots)
    acc = mon.accounting(slots, t, t + 10)
    for s in ("actor", "inference"):
        assert tot["services"][s]["busy_s"] == pytest.approx(acc["services"][s]["busy_s"])
        assert 0.0 <= tot["services"][s]["utilization"] <= 1.0
    assert tot["services"]["simulator"]["slots"] == 1 and tot["services"]["simulator"]["busy_s"] == 0.0
