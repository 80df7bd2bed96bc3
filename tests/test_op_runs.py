"""Low-level ops grouped in one MLflow run per client session (``nexus.control.jobs.op_runs``), without a cluster:
session ids, the per-session run bookkeeping and idle closing on a fake clock, through a real TrackerLink into
a real Tracker on a sqlite MLflow store (and a tracker restart in between)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from nexus.control.jobs.op_runs import OpRuns
from nexus.control.monitoring.tracking_link import TrackerLink
from nexus.errors import SpecError
from nexus.spec import DEFAULT_SESSION, check_session
from nexus.tracking.tracker import Tracker


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("bad", ["", " ", "a b", "x" * 65, "../etc", "-lead", "_x", "sess;drop", "é", 7, b"ab"])
def test_bad_session_ids_are_spec_errors(bad):
    with pytest.raises(SpecError, match="session id"):
        check_session(bad)


def test_session_ids_default_and_client_ids():
    from nexus.client.api import Nexus

    assert check_session(None) == DEFAULT_SESSION
    assert check_session("0f" * 16) == "0f" * 16 and check_session("A-b_9") == "A-b_9"
    a, b = Nexus("http://127.0.0.1:9"), Nexus("http://127.0.0.1:9", session="bench-1")
    try:
        assert check_session(a.session) == a.session != Nexus("http://127.0.0.1:9").session
        assert b.session == "bench-1"
    finally:
        a.close(), b.close()
    with pytest.raises(SpecError, match="session id"):
        Nexus("http://127.0.0.1:9", session="no spaces")


FB = {"version": 0, "metrics": {"loss": 0.8, "mse": 0.4}}
STEP = {"version": 0, "metrics": {"grad_norm": 2.5, "lr": 1e-3, "optimizer_steps": 1.0}}


def _save(v: int) -> dict:
    return {"version": v, "metrics": {"version": v, "weight_sync_s": 0.01, "weight_sync_bytes": 1234}}


def test_one_run_per_session_monotonic_steps_idle_close_and_tracker_restart(tmp_path):
    cfg = {"root": str(tmp_path)}
    trackers = {"t1": Tracker(cfg)}
    weights = tmp_path / "v000001.pt"
    weights.write_bytes(b"head")

    async def send(address, calls):
        tr = trackers[address]
        return [getattr(tr, m)(**kw) for m, kw in calls]

    async def main() -> tuple[OpRuns, dict[str, list[str]]]:
        link = TrackerLink(send)
        link.start()
        link.attach("t1")
        clock = Clock()
        runs = OpRuns(link, idle_s=120, clock=clock)

        def op(tenant, session, verb, result, dt=1.0):
            tok = runs.begin(tenant, session)
            clock.t += dt
            runs.finish(tok, verb, result, lambda: {"name": tenant, "lr": 1e-3},
                        lambda v: str(weights) if v == 1 else str(tmp_path / "missing.pt"))

        op("a", "s1", "forward_backward", None)  # a failed op opens no run
        assert runs.view()[0]["run"] is None
        op("a", "s1", "forward_backward", FB)  # t 1001 -> 1002: arrival 1001 is the start
        op("a", "s2", "forward_backward", FB)  # a second client of the same tenant: its own run
        op("a", "s1", "optim_step", STEP)
        op("b", DEFAULT_SESSION, "forward_backward", FB)
        assert len({v["run"] for v in runs.view()}) == 3
        await link.flush(10)

        # the tracker's worker is lost and a new one serves: the link reopens the runs and resends
        link.lost()
        op("a", "s1", "save_weights", _save(1))  # queued while no tracker serves
        trackers["t2"] = Tracker(cfg)
        link.attach("t2")
        op("a", "s1", "forward_backward", {"version": 1, "metrics": {"loss": 0.5}})
        assert await link.flush(10)
        t_last_s1 = clock.t

        clock.t += 119  # s1 idle 119 s: stays open; s2 / b idle longer: end
        ended_early = runs.close_idle()
        assert not any("-s1-" in k for k in ended_early) and len(ended_early) == 2
        tok = runs.begin("a", "s1")  # an op in flight: never idle however long it waits in the queue
        clock.t += 500
        assert runs.close_idle() == []
        runs.finish(tok, "optim_step", STEP, lambda: {})
        t_last_s1 = clock.t
        clock.t += 120
        (s1_key,) = runs.close_idle()
        op("a", "s1", "forward_backward", FB)  # the same client later: a new run
        late = runs.begin("a", "s1")
        assert len(runs.close_tenant("a")) == 1 and runs.sessions == {}
        runs.finish(late, "optim_step", STEP, lambda: {})  # after the tenant's deletion: not recorded
        assert runs.sessions == {} and runs.close_all() == []
        assert await link.flush(10)
        await link.close()
        return runs, {"s1": [s1_key], "t_last_s1": [t_last_s1]}

    runs, keys = asyncio.run(main())
    assert len(runs.ended) == 4 and len(set(runs.ended)) == 4  # every run its own key

    client = trackers["t2"]._mlflow()
    found = client.search_runs([trackers["t2"].experiment_id], filter_string="tags.`nexus.kind` = 'ops'")
    assert len(found) == 4 and all(r.info.status == "FINISHED" for r in found)
    by_key = {r.data.tags["nexus.job"]: r for r in found}
    r1 = by_key[keys["s1"][0]]
    assert r1.info.run_name == "a-ops-s1" and r1.data.tags["nexus.session"] == "s1"
    assert r1.data.tags["nexus.tenant"] == "a" and r1.data.params["session"] == "s1"
    assert r1.info.start_time == 1_001_000  # the first op's arrival (not the failed op's)
    assert r1.info.end_time == int(keys["t_last_s1"][0] * 1000)  # the last op's end, not the idle check's
    hist = {m: [(p.step, p.value) for p in client.get_metric_history(r1.info.run_id, m)]
            for m in ("train/loss", "train/grad_norm", "train/published_version", "system/weight_sync_s")}
    # one step per op of the session (1 fb, 2 step, 3 save, 4 fb, 5 step); the restart repeated nothing
    assert hist["train/loss"] == [(1, 0.8), (4, 0.5)]
    assert [s for s, _ in hist["train/grad_norm"]] == [2, 5]
    assert hist["train/published_version"] == [(3, 1.0)] and [s for s, _ in hist["system/weight_sync_s"]] == [3]
    assert "train/version" not in r1.data.metrics
    assert r1.data.tags["nexus.version"] == "1"
    assert [a.path for a in client.list_artifacts(r1.info.run_id, "weights")] == ["weights/v000001.pt"]
    result = json.loads(Path(client.download_artifacts(r1.info.run_id, "result.json", str(tmp_path))).read_text())
    assert result == {"session": "s1", "ended": "idle", "ops": 5, "forward_backward": 2, "optim_step": 2,
                      "save_weights": 1, "version": 1}
    names = sorted(r.info.run_name for r in found)
    assert names == ["a-ops-s1", "a-ops-s1", "a-ops-s2", f"b-ops-{DEFAULT_SESSION[:8]}"]
    s2 = next(r for r in found if r.info.run_name == "a-ops-s2")
    assert (s2.info.start_time, s2.info.end_time) == (1_002_000, 1_003_000)


def test_gateway_refuses_a_bad_session_header_before_anything_runs(tmp_path):
    """The gateway's op routes check the session header first: a bad id is a 422 SpecError and the backend (not
    even connected here: no service behind it) is never asked."""
    from fastapi.testclient import TestClient

    from nexus.config.service import ServiceConfig
    from nexus.gateway.app import create_app
    from nexus.gateway.auth import TokenStore
    from nexus.gateway.backend import Backend
    from nexus.spec import SESSION_HEADER

    cfg = ServiceConfig(root=str(tmp_path))
    tokens = TokenStore(tmp_path / "gateway")
    operator = (tmp_path / "gateway" / "operator.token").read_text().strip()
    api = TestClient(create_app(cfg, Backend("tcp://127.0.0.1:9"), tokens))  # no lifespan: never connects
    for verb in ("optim_step", "save_weights", "forward_backward"):
        r = api.post(f"/v1/tenants/a/{verb}", json={"batch": {}} if verb == "forward_backward" else None,
                     headers={"Authorization": f"Bearer {operator}", SESSION_HEADER: "two words"})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["class"] == "SpecError" and "session id" in r.json()["error"]["message"]
