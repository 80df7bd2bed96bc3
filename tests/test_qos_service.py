"""Serving at QoS on one live service (real Dask, DeepSpeed, ManiSkill, HTTP on loopback):

* a predict's hops in its ``Server-Timing`` header; the admin QoS view;
* a tenant past its concurrent-predict budget answered 429 with ``Retry-After`` (and nothing done), the Python
  client retrying with backoff until every call is answered; the 429 documented in the OpenAPI;
* per-tenant latency histograms and refusals on the scheduler's ``/metrics`` and the ``/nexus`` page;
* simulators shared fairly: another tenant's short RL job completes while a tenant's two 500-episode
  evaluations hold the simulators; the evaluations' cancel answers ``cancelled``, their producers stop,
  their markers go, and the tenant evaluates again.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from nexus.client.api import Nexus
from nexus.client.faults import wait_for
from nexus.client.http import HttpTransport
from nexus.features import Observation
from nexus.spec import TenantSpec
from nexus.wire.inputs import encode_array
from nexus.wire.qos import HOPS, parse_server_timing
from nexus.worker.plugin import producer_jobs

pytestmark = pytest.mark.cluster

PUSH = "maniskill/pushcube-state"
OBS = {"state": encode_array(np.linspace(-1, 1, 35).astype(np.float32))}


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    root = tmp_path_factory.mktemp("qos")
    with Nexus.local(root, n_sim=2, tenant_limits={"p1": {"max_inflight_predicts": 1}},
                     limits={"max_request_bytes": 1 << 20}) as nx:
        t = {name: nx.create_tenant(TenantSpec(name=name, env=PUSH, seed=i + 1))
             for i, name in enumerate(("q", "p1", "sa", "sb"))}
        yield nx, t


def _get(nx, path: str) -> str:
    return urllib.request.urlopen(nx.service.dashboard_link.replace("/status", path), timeout=60).read().decode()


def test_hops_refusals_client_retries_and_latency_on_metrics(svc):
    nx, t = svc
    url = nx.service.gateway_url
    with httpx.Client(base_url=url, timeout=120) as http:
        r = http.post("/v1/tenants/q/predict", json={"observation": OBS},
                      headers={"Authorization": f"Bearer {t['q'].token}"})
        assert r.status_code == 200 and len(r.json()["action"]) == 4
        hops = parse_server_timing(r.headers["server-timing"])
        assert set(HOPS) | {"total"} <= set(hops) and hops["total"] >= hops["forward"] > 0

        # p1 may have one predict at a time: 8 sent together, the others are refused at once, nothing done
        def burst() -> list[httpx.Response]:
            gate = threading.Barrier(8)

            def one(_):
                gate.wait()
                return http.post("/v1/tenants/p1/predict", json={"observation": OBS},
                                 headers={"Authorization": f"Bearer {t['p1'].token}"})
            with ThreadPoolExecutor(8) as pool:
                return list(pool.map(one, range(8)))

        refused = []
        for _ in range(10):
            answers = burst()
            assert {a.status_code for a in answers} <= {200, 429}
            refused = [a for a in answers if a.status_code == 429]
            if refused:
                break
        assert refused, "8 predicts at once never went past a budget of 1"
        a = refused[0]
        assert int(a.headers["retry-after"]) >= 1
        body = a.json()
        assert body["error"]["class"] == "Overloaded" and "max_inflight_predicts=1" in body["error"]["message"]
        assert body["retry_after_s"] > 0

        # the Python client sends refused calls again (backoff) until each is answered
        client = HttpTransport(url, token=t["p1"].token)
        obs = Observation(state=np.linspace(-1, 1, 35).astype(np.float32))
        for _ in range(10):
            gate = threading.Barrier(8)

            def call(_, gate=gate):
                gate.wait()
                return client.predict("p1", obs)
            with ThreadPoolExecutor(8) as pool:
                outs = list(pool.map(call, range(8)))
            assert all(o["action"].shape == (4,) for o in outs)
            if client.refused:
                break
        assert client.refused > 0
        client.close()

        doc = http.get("/openapi.json").json()
        # every route behind a budget of calls at once documents its 429 (predicts, and the low-level calls
        # counted by max_queued_ops)
        for route in ("predict", "predict_batch", "forward_backward", "forward", "optim_step", "save_state",
                      "load_state", "save_weights"):
            r429 = doc["paths"][f"/v1/tenants/{{tenant}}/{route}"]["post"]["responses"]["429"]
            assert "Retry-After" in r429["headers"], route
        qos = http.get("/v1/admin/qos", headers={"Authorization": f"Bearer {nx.service.operator_token}"}).json()
        assert set(qos["hops_mean_ms"]) == set(HOPS) and qos["inflight_total"] == 0
        assert qos["shed"] == 0  # nothing waited for the engine long enough to shed anyone
        assert qos["gc"]["frozen"] > 0 and sum(qos["gc"]["count"]) > 0  # start-up frozen (gc.freeze)
        assert http.get("/v1/admin/qos", headers={"Authorization": f"Bearer {t['q'].token}"}).status_code == 403

    def reported() -> str | None:
        text = _get(nx, "/metrics")
        return text if 'nexus_predict_rejected_total{tenant="p1"}' in text else None

    metrics = wait_for(reported, 60, 1.0, "the gateway's latency report on /metrics")
    assert 'nexus_predict_latency_seconds_bucket{le="+Inf",tenant="q"}' in metrics
    line = next(x for x in metrics.splitlines() if x.startswith('nexus_predict_rejected_total{tenant="p1"}'))
    assert float(line.split()[-1]) >= len(refused)
    rows = nx.service.client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["nexus"].latency.rows())
    assert {r["tenant"] for r in rows} >= {"q", "p1"}


ROUTE_ONLY = "application/nexus+json"  # JSON to FastAPI's route, not a type the fast path takes: the route answers


def test_fast_path_answers_as_the_route(svc):
    """Each predict, sent once to the fast path (``nexus.gateway.fast_predict``) and once past it to the FastAPI
    route: the same status and body (actions within float noise: grouped forwards differ by their groups)."""
    nx, t = svc
    op = {"Authorization": f"Bearer {nx.service.operator_token}"}
    q = {"Authorization": f"Bearer {t['q'].token}"}
    cases = [  # (tenant, headers, body, whether the fast path answers it)
        ("q", q, {"observation": OBS}, True),
        ("q", q, {"observation": OBS, "deterministic": False, "seed": 7, "n": 3}, True),
        ("q", q, {"observation": OBS, "version": 0}, True),
        ("q", {}, {"observation": OBS}, True),  # no token
        ("q", {"Authorization": f"Basic {t['q'].token}"}, {"observation": OBS}, True),  # not a bearer token
        ("q", {"Authorization": "Bearer not-a-token"}, {"observation": OBS}, True),
        ("q", {"Authorization": f"Bearer {t['p1'].token}"}, {"observation": OBS}, True),  # another tenant's
        ("nobody", op, {"observation": OBS}, True),
        ("q", q, {"observation": OBS, "seed": 3}, True),  # seed with deterministic
        ("q", q, {"observation": {"state": [0.5, 0.1]}}, True),  # the wrong state size
        ("q", q, {"observation": {"state": [float("nan")] * 35}}, True),
        ("q", q, {"observation": OBS, "version": 10**6}, True),  # no such version
        # bodies the model refuses: the route answers them all
        ("q", q, b'{"observation": ', False),  # not JSON
        ("q", q, {"observation": OBS, "extra": 1}, False),
        ("q", {"Authorization": "Bearer not-a-token"}, {"observation": OBS, "n": 0}, False),  # token first: 401
    ]
    with httpx.Client(base_url=nx.service.gateway_url, timeout=120) as http:
        def served() -> int:
            return http.get("/v1/admin/qos", headers=op).json()["fast_path_served"]

        for tenant, headers, body, fast_path in cases:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            answers = []
            for ctype in ("application/json", ROUTE_ONLY):
                before = served()
                r = http.post(f"/v1/tenants/{tenant}/predict", content=raw, headers={**headers, "Content-Type": ctype})
                answers.append((r.status_code, r.json(), served() - before))
            (fast_status, fast, n_fast), (route_status, route, n_route) = answers
            assert (n_fast, n_route) == (int(fast_path), 0), body
            assert fast_status == route_status, (body, fast, route)
            if fast_status != 200:
                assert fast == route, body
                continue
            assert fast.keys() == route.keys() and fast["version"] == route["version"]
            np.testing.assert_allclose(fast["action"], route["action"], atol=1e-4)
            if "logprobs" in fast:
                np.testing.assert_allclose(fast["logprobs"], route["logprobs"], atol=1e-3)

        # a chunked body (no Content-Length) is read whole by the fast path; one over max_request_bytes is refused
        # before it (the body limit sits outside)
        def chunks(body: bytes, size: int = 1 << 16):
            yield from (body[i:i + size] for i in range(0, len(body), size))

        before = served()
        r = http.post("/v1/tenants/q/predict", content=chunks(json.dumps({"observation": OBS}).encode(), 7),
                      headers={**q, "Content-Type": "application/json"})
        assert r.status_code == 200 and len(r.json()["action"]) == 4 and served() == before + 1
        big = b'{"observation": {"state": [' + b"0," * 700_000 + b'0]}}'
        r = http.post("/v1/tenants/q/predict", content=chunks(big), headers={**q, "Content-Type": "application/json"})
        assert r.status_code == 413 and served() == before + 1


def _producers(nx) -> dict[str, list[str]]:
    """The running producers' jobs on each SIM worker (their hosts' own view)."""
    sims = [w["address"] for w in nx.status()["workers"] if "SIM" in w["resources"]]
    return nx.service.client.run(producer_jobs, workers=sims)


def test_short_rl_job_completes_beside_long_evaluations_and_cancel_stops_them(svc):
    nx, t = svc
    evals = [t["sa"].evaluate(episodes=500) for _ in range(2)]
    wait_for(lambda: all(e.info()["state"] == "running" for e in evals), 300, what="both evaluations running")
    wait_for(lambda: any(j.startswith("sa-") for js in _producers(nx).values() for j in js), 300,
             what="the evaluations on the simulators")
    sims = nx.status()["simulators"]
    assert sims["capacity"] == 2 and sims["fair"] and sims["held"].get("sa", 0) >= 1
    job = t["sb"].rl(updates=2, episodes_per_batch=2, collectors=2)
    assert job.result(timeout=900)["updates"] == 2
    # before the fair share, this job waited for the evaluations' tasks to end (1000 episodes)
    assert [e.info()["state"] for e in evals] == ["running", "running"]
    for e in evals:
        assert e.cancel()["state"] == "cancelled"
    wait_for(lambda: not any(j.startswith("sa-") for js in _producers(nx).values() for j in js), 60,
             what="the cancelled evaluations' producers stopped")
    again = t["sa"].evaluate(episodes=1)  # its slots and evaluation quota are back
    assert again.result(timeout=300)["episodes"] == 1
