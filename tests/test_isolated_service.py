"""The isolated baseline through the real service (local Dask cluster, ManiSkill, DeepSpeed): with the
``isolated`` scheduler, tenants' jobs run one after another in submission order — no two tenants' work
overlaps on any service (from the services' own spans) — and the accounting of that run is consistent."""

from __future__ import annotations

import itertools
import time

import pytest

from nexus.client.api import Nexus
from nexus.spec import TenantSpec

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def nx(tmp_path_factory):
    with Nexus.local(tmp_path_factory.mktemp("isolated"), n_sim=2, scheduler="isolated",
                     datapath={"envs_per_producer": 2}) as nexus:
        yield nexus


def test_isolated_tenants_never_overlap_and_accounting_holds(nx):
    assert nx.service.internal("nexus_scheduling")["admission"]["isolated"]
    rl = nx.create_tenant(TenantSpec(name="iso-rl", env="maniskill/pushcube-state", action_dim=4, hidden_dim=64,
                                     seed=3))
    sft = nx.create_tenant(TenantSpec(name="iso-sft", dataset="pickcube-scripted", env="maniskill/pickcube-state",
                                      action_dim=4, hidden_dim=64, seed=4))
    t0 = time.time()
    jobs = [rl.rl(updates=1, episodes_per_batch=2, collectors=1), sft.sft(steps=3, batch_size=16),
            rl.evaluate(episodes=2)]  # rl's eval was submitted after sft's job: it waits for it (FIFO)
    assert jobs[1].info()["state"] == "queued"
    for j in jobs:
        j.result(timeout=600)
    t1 = time.time()
    views = [j.info() for j in jobs]
    assert all(v["state"] == "done" for v in views), views
    for a, b in itertools.pairwise(views):
        assert a["t_end"] <= b["t_start"], (a, b)  # one tenant's job after the other's, in submission order
    assert views[1]["t_start"] > views[1]["t_submit"]  # it really waited

    nx.flush()
    spans = [s for s in nx.monitoring(since=t0)["spans"] if s["t0"] >= t0]
    by_tenant = {tn: [s for s in spans if s["tenant"] == tn] for tn in {s["tenant"] for s in spans}}
    assert set(by_tenant) == {"iso-rl", "iso-sft"}, sorted(by_tenant)  # no mixed inference group either
    assert {s["service"] for s in by_tenant["iso-rl"]} == {"actor", "inference", "simulator"}
    for x, y in itertools.product(by_tenant["iso-rl"], by_tenant["iso-sft"]):
        assert x["t1"] <= y["t0"] or y["t1"] <= x["t0"], (x, y)  # no two tenants' work at the same time

    acc = nx.service.internal("nexus_accounting", t0=t0, t1=t1)
    assert acc["wall_s"] == pytest.approx(t1 - t0)
    allocated = {"actor": 1, "inference": 1, "simulator": 2}  # the module's cluster: spans map onto its slots
    assert {s: r["slots"] for s, r in acc["services"].items()} == allocated, acc
    assert {s: r["slots"] for s, r in nx.status()["accounting"]["services"].items()} == allocated
    for service, row in acc["services"].items():
        assert row["device_s"] == pytest.approx(row["slots"] * acc["wall_s"])
        assert all(0 <= b <= acc["wall_s"] + 1e-6 for b in row["busy_per_slot_s"].values()), row
        assert 0.0 < row["utilization"] <= 1.0, (service, row)
    sim = acc["services"]["simulator"]
    assert sim["split_s"]["stepping"] > 0 and sim["split_s"]["waiting_for_actions"] > 0
    assert sum(sim["split_s"].values()) == pytest.approx(sim["busy_s"], rel=1e-6)
    assert nx.status()["accounting"]["services"]["actor"]["busy_s"] >= acc["services"]["actor"]["busy_s"] - 1e-6


def test_a_scheduler_switched_on_the_idle_service_moves_t_and_b_to_the_engines(nx):
    from nexus.config.service import Scheduler

    engine = nx.service.engine()
    first = nx.service.internal("nexus_scheduling")["scheduler"]
    before = engine.batching().result(timeout=30)
    assert before == {"max_wait_s": first["infer_max_wait_s"], "max_batch": first["infer_max_batch"]}
    shared = {"name": "shared-wide", "settings": {"dispatch": {"isolated": False}, "infer_max_wait_s": 0.02,
                                                  "infer_max_batch": 12}}
    try:
        view = nx.service.internal("nexus_set_scheduler", scheduler=shared)
        assert not view["admission"]["isolated"] and view["scheduler"]["name"] == "shared-wide"
        assert engine.batching().result(timeout=30) == {"max_wait_s": 0.02, "max_batch": 12}
        with pytest.raises(Exception, match="infer_max_batch"):  # refused whole: nothing of it applies
            nx.service.internal("nexus_set_scheduler", scheduler={"name": "bad", "settings": {
                "dispatch": {"isolated": True}, "infer_max_batch": 0}})
        assert not nx.service.internal("nexus_scheduling")["admission"]["isolated"]
        assert engine.batching().result(timeout=30)["max_batch"] == 12
    finally:
        nx.service.internal("nexus_set_scheduler", scheduler=Scheduler.load(first["name"]).model_dump())
    assert engine.batching().result(timeout=30) == before
    assert nx.service.internal("nexus_scheduling")["admission"]["isolated"]
