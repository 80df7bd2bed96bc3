"""Many tenants on one backbone: views that never grow with the number of tenants or jobs (a page at a time,
limit + cursor), routing that stays O(T log T), the control plane's decision timings, and idle tenants'
actor slots offloaded to disk and restored transparently at their next item."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import numpy as np
import pytest

from nexus.client.api import Nexus
from nexus.control.dispatch.decisions import DecisionTimes
from nexus.control.dispatch.routing import Routing
from nexus.errors import SpecError
from nexus.features import Observation
from nexus.spec import TenantSpec
from nexus.wire.paging import MAX_LIMIT, Page

PUSH = "maniskill/pushcube-state"


# -- pages -------------------------------------------------------------------------------------------------
@dataclass
class _Job:
    job_id: str
    tenant: str


def _walk(names: list[str], jobs: list[_Job], limit: int, tenant: str | None = None):
    """Every page of (names, jobs) as the status builds them; returns the pages' tenants and jobs."""
    seen_t, seen_j, cursor = [], [], None
    for _ in range(1000):
        page = Page.parse(limit, cursor, tenant)
        ts, more_t = page.tenants(names)
        js, more_j = page.jobs(jobs)
        info = page.info(ts, more_t, js, more_j, {"tenants_total": len(names)})
        assert len(ts) <= limit and len(js) <= limit
        seen_t += ts
        seen_j += [j.job_id for j in js]
        cursor = info["next_cursor"]
        if cursor is None:
            return seen_t, seen_j
    raise AssertionError("paging never ended")


def test_pages_cover_every_tenant_and_job_once_in_order():
    names = [f"t{i:03d}" for i in random.Random(0).sample(range(250), 250)]
    jobs = [_Job(f"{names[i % 250]}-rl-{i + 1}", names[i % 250]) for i in range(333)]
    for limit in (1, 7, 100, MAX_LIMIT):
        ts, js = _walk(names, jobs, limit)
        assert ts == sorted(names)  # name order, each once
        assert js == [j.job_id for j in reversed(jobs)]  # newest first, each once
    one = names[3]
    ts, js = _walk(names, jobs, 10, tenant=one)
    assert ts == [one] and js == [j.job_id for j in reversed(jobs) if j.tenant == one]
    assert _walk(names, jobs, 10, tenant="nobody") == ([], [])


def test_a_bad_page_is_refused_with_a_short_message():
    for limit in (0, MAX_LIMIT + 1, "ten", True, 2.5):
        with pytest.raises(SpecError, match="limit"):
            Page.parse(limit)
    for cursor in ("x" * 10_000, "%%%", "eyJ0IjogMX0"):  # the last: valid base64 JSON of the wrong shape
        with pytest.raises(SpecError, match="cursor") as e:
            Page.parse(10, cursor)
        assert len(str(e.value)) < 200  # quotes a short prefix only


# -- routing -----------------------------------------------------------------------------------------------
def _reference_rebalance(routes: dict[str, int], tenants: list[str], serving: list[int]) -> dict[str, int]:
    """The rule as it was written first (quadratic): keep serving routes, assign the others in order to the
    least loaded, then move the most loaded engine's last tenant by name until within one."""
    routes = {t: s for t, s in routes.items() if t in tenants}
    for t in tenants:
        if routes.get(t) not in serving:
            load = Counter(routes.values())
            routes[t] = min(serving, key=lambda s: (load[s], s))
    while True:
        load = {s: [t for t, x in sorted(routes.items()) if x == s] for s in sorted(serving)}
        hi = max(load, key=lambda s: (len(load[s]), s))
        lo = min(load, key=lambda s: (len(load[s]), s))
        if len(load[hi]) - len(load[lo]) <= 1:
            return routes
        routes[load[hi][-1]] = lo


def test_rebalance_gives_the_reference_routes_and_stays_fast_at_a_thousand_tenants():
    rng = random.Random(1)
    for _ in range(200):
        tenants = [f"t{i}" for i in rng.sample(range(60), rng.randint(0, 40))]
        serving = sorted(rng.sample(range(6), rng.randint(1, 4)))
        start = {t: rng.randrange(6) for t in tenants if rng.random() < 0.7}
        r = Routing()
        r.routes = dict(start)
        r.rebalance(tenants, serving)
        assert r.routes == _reference_rebalance(dict(start), tenants, serving)
    big = Routing()
    names = [f"t{i:04d}" for i in range(1024)]
    big.rebalance(names, [0])
    big.rebalance(names, [0, 1, 2, 3])  # three engines join: three quarters of the tenants move
    assert sorted(Counter(big.routes.values()).values()) == [256, 256, 256, 256]
    assert big.times.view()["rebalance"]["count"] == 2


def test_decision_times_report_percentiles_of_recent_operations():
    times = DecisionTimes(keep=100)
    for i in range(1, 201):
        times.record("pop", i * 1e-6)
    with times.time("put"):
        pass
    v = times.view()
    assert v["pop"]["count"] == 200 and v["pop"]["p50_us"] == pytest.approx(151, abs=1)  # the last 100 only
    assert v["pop"]["p99_us"] == pytest.approx(200, abs=1) and v["pop"]["max_us"] == pytest.approx(200)
    assert v["put"]["count"] == 1 and v["put"]["p50_us"] >= 0


# -- a service with many tenants and offloading ---------------------------------------------------------
def _batch(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"observations": [Observation(state=rng.standard_normal(35).astype(np.float32)) for _ in range(n)],
            "actions": rng.uniform(-1, 1, (n, 4)).astype(np.float32)}


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout:g} s: {what}")


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    with Nexus.local(tmp_path_factory.mktemp("scale"), n_sim=1, offload_idle_s=2.0) as nx:
        tenants = {n: nx.create_tenant(TenantSpec(name=n, env=PUSH, seed=i, hidden_dim=32))
                   for i, n in enumerate(("p-a", "p-b", "p-c", "p-d", "p-e"))}
        yield nx, tenants


def test_status_pages_through_the_gateway(svc):
    nx, tenants = svc
    url, op = nx.service.gateway_url, {"Authorization": f"Bearer {nx.service.operator_token}"}
    with httpx.Client(base_url=url, timeout=60) as http:
        names, cursor = [], None
        while True:
            r = http.get("/v1/status", params={"limit": 2, **({"cursor": cursor} if cursor else {})}, headers=op)
            assert r.status_code == 200
            page = r.json()
            assert len(page["tenants"]) <= 2 and page["page"]["tenants_total"] == 5
            shown = {t["tenant"] for t in page["tenants"]}
            assert set(page["inference"]["routes"]) == shown  # the page's tenants' routes only
            (engine,) = page["inference"]["engines"]
            assert set(engine["tenants"]) == shown and engine["tenants_total"] == 5
            names += [t["tenant"] for t in page["tenants"]]
            cursor = page["page"]["next_cursor"]
            if cursor is None:
                break
        assert names == sorted(tenants)
        one = http.get("/v1/status", params={"tenant": "p-c"}, headers=op).json()
        assert [t["tenant"] for t in one["tenants"]] == ["p-c"]
        bad = http.get("/v1/status", params={"cursor": "not-a-cursor"}, headers=op)
        assert bad.status_code == 422 and "cursor" in bad.json()["error"]["message"]
        assert http.get("/v1/status", params={"limit": 0}, headers=op).status_code == 422
        own = http.get("/v1/status", headers={"Authorization": f"Bearer {tenants['p-b'].token}"}).json()
        assert [t["tenant"] for t in own["tenants"]] == ["p-b"]
        other = http.get("/v1/status", params={"tenant": "p-a"},
                         headers={"Authorization": f"Bearer {tenants['p-b'].token}"})
        assert other.status_code == 200 and other.json()["tenants"] == []  # unknown to p-b's token
        mon = http.get("/v1/admin/monitoring", params={"limit": 1}, headers=op).json()
        assert len(mon["status"]["tenants"]) == 1 and set(mon["metering"]) <= {mon["status"]["tenants"][0]["tenant"]}
    st = nx.status(limit=3)
    assert len(st["tenants"]) == 3 and st["page"]["next_cursor"] is not None
    assert [t["tenant"] for p in nx.pages(limit=2) for t in p["tenants"]] == sorted(tenants)
    assert "route" in nx.status()["decisions"]  # each tenant was routed at creation


def _slots(nx) -> dict:
    from nexus.worker.plugin import slot_states

    actor = next(w["address"] for w in nx.status()["workers"] if "ACTOR" in w["resources"])
    return nx.service.client.run(slot_states, workers=[actor])[actor]


def test_idle_slots_go_to_disk_and_come_back_at_the_next_item(svc):
    nx, tenants = svc
    a = tenants["p-a"]
    a.forward_backward(_batch(4, 0)).result(120)
    a.optim_step().result(120)
    v1 = a.save_weights().result(120)
    assert v1 == 1
    row = _wait(lambda: next((t for t in nx.status(tenant="p-a")["tenants"] if t["offloaded"]), None), 90,
                "p-a offloaded after its idle time")
    assert row["version"] == v1 and "p-a" not in _slots(nx)  # the actor freed it
    assert _wait(lambda: all(t["offloaded"] for t in nx.status()["tenants"]), 90, "every idle tenant offloaded")
    # the next items restore it from its checkpoint: same version, its optimizer state, nothing lost
    a.forward_backward(_batch(4, 1)).result(180)
    restored = _slots(nx)["p-a"]
    assert (restored["version"], restored["pending_backward"]) == (v1, 1) and restored["optimizer_bytes"] > 0
    a.optim_step().result(120)
    assert a.save_weights().result(120) == v1 + 1
    assert not nx.status(tenant="p-a")["tenants"][0]["offloaded"]
    manifest = json.loads((nx.service.config.tenants_dir / "p-a" / "manifest.json").read_text())
    assert not manifest.get("restores")  # no update lost: the checkpoint held the offloaded version
    # a job on an offloaded tenant runs too (the predict path never needed the actor's slot)
    b = tenants["p-b"]
    assert b.predict_action(Observation(state=np.zeros(35, np.float32))).result(60)["version"] == 0
    job = b.evaluate(episodes=1)
    assert job.result(timeout=300)["episodes"] == 1
    decisions = nx.status()["decisions"]
    assert {"reserve", "put", "pop", "done", "pump", "route"} <= set(decisions)
    assert all(d["p99_us"] >= d["p50_us"] >= 0 for d in decisions.values())
