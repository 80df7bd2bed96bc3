"""Failure isolation, elastic inference and in-place restarts on one live local cluster: real processes,
real SIGKILL, two RL tenants.

Order matters (one cluster for the module): the pool starts with one engine (so both tenants' requests
share groups), scales 1 -> 2 -> 1 under load, then runs with two engines for the kill tests, then
cancel and delete.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from nexus.client.api import Nexus
from nexus.client.faults import kill_worker, kill_worker_while, wait_for, worker_of_role
from nexus.errors import NotFound, SpecError, Unavailable
from nexus.features import Observation
from nexus.spec import TenantSpec

pytestmark = pytest.mark.cluster

RL = dict(episodes_per_batch=1, collectors=1)


@pytest.fixture(scope="module")
def nx(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    with Nexus.local(root, n_sim=2, n_infer=2, inference_engines=1) as nexus:
        nexus.create_tenant(TenantSpec(name="fa", env="maniskill/pushcube-state", seed=31))
        nexus.create_tenant(TenantSpec(name="fb", env="maniskill/pushcube-state", seed=32))
        yield nexus


def _manifest(nx: Nexus, tenant: str) -> dict:
    t = {x["tenant"]: x for x in nx.status()["tenants"]}[tenant]
    return json.loads((Path(t["output_dir"]) / "manifest.json").read_text())


def _published(nx: Nexus, tenant: str) -> dict[int, str]:
    """version -> sha256 of its weights file, checking the manifest's own record on the way."""
    m = _manifest(nx, tenant)
    versions = [v["version"] for v in m["versions"]]
    assert versions == sorted(set(versions)), f"versions re-used or out of order: {versions}"
    out = {}
    for v in m["versions"]:
        digest = hashlib.sha256(Path(v["weights"]).read_bytes()).hexdigest()
        assert digest == v["sha256"], f"weights of {tenant} v{v['version']} changed"
        out[v["version"]] = digest
    return out


def _roles(nx: Nexus) -> dict[str, dict]:
    return {r["role"]: r for r in nx.status()["roles"]}


def _all_healthy(nx: Nexus) -> bool:
    return all(r["state"] == "healthy" for r in nx.status()["roles"] if not r["role"].startswith("producer/"))


def _obs(dim: int = 35) -> Observation:
    return Observation(state=np.random.default_rng(0).normal(size=dim).astype(np.float32))


def _run_two_and_kill(nx: Nexus, kill, updates: int = 6, **job):
    """Both tenants train; ``kill()`` runs once both have 2 updates (a tenant ahead still has updates left
    then); returns (results, kill info)."""
    before = {t: _published(nx, t) for t in ("fa", "fb")}
    jobs = {t: nx.tenant(t).rl(updates=updates, **RL, **job) for t in ("fa", "fb")}
    wait_for(lambda: all(j.info()["progress"].get("updates", 0) >= 2 for j in jobs.values()), 600,
             what="two updates each")
    mid = {t: _published(nx, t) for t in ("fa", "fb")}
    info = kill()
    results = {t: j.result(timeout=600) for t, j in jobs.items()}
    for t in ("fa", "fb"):
        after = _published(nx, t)
        for v, digest in {**before[t], **mid[t]}.items():
            assert after[v] == digest, f"{t} v{v} rewritten"
        assert results[t]["updates"] == updates and max(after) == results[t]["version"]
        assert max(after) > max(mid[t]), "training went on after the kill"
    wait_for(lambda: _all_healthy(nx), 300, what="all roles healthy")
    return results, info


# -- isolation ---------------------------------------------------------------------------------------------
def test_malformed_observation_fails_only_its_own_request(nx):
    predictor = nx.service.predictor()
    assert nx.status()["inference"]["routes"]["fa"] == nx.status()["inference"]["routes"]["fb"]
    before = nx.service.engine(0).engine_stats().result()["groups"]
    good = [predictor.predict("fb", _obs(), deterministic=True) for _ in range(24)]
    bad = [predictor.predict("fa", _obs(40), deterministic=True) for _ in range(8)]
    bad += [predictor.predict("fa", Observation(state=np.full(35, np.nan, np.float32)), deterministic=True)]
    good += [predictor.predict("fa", _obs(), deterministic=True) for _ in range(8)]
    for f in good:
        assert f.result(timeout=120)["action"].shape == (4,)
    for f in bad:
        with pytest.raises(SpecError, match="shape|NaN"):
            f.result(timeout=120)
    stats = nx.service.engine(0).engine_stats().result()
    assert stats["groups"] > before and max(stats["group_sizes"][-10:]) > 1, "requests were grouped"


# -- elastic inference -----------------------------------------------------------------------------------------
def test_scale_1_2_1_answers_every_request_once_and_eval_keeps_its_version(nx):
    predictor = nx.service.predictor()
    pinned = nx.tenant("fa").version
    answers: dict[str, list] = {"fa": [], "fb": []}
    errors: list[BaseException] = []
    stop = threading.Event()

    def send(tenant: str) -> None:
        while not stop.is_set():
            futs = [predictor.predict(tenant, _obs(), deterministic=True) for _ in range(4)]
            for f in futs:
                try:
                    answers[tenant].append(f.result(timeout=300))
                except BaseException as e:  # noqa: BLE001 (collected and asserted below)
                    errors.append(e)

    senders = [threading.Thread(target=send, args=(t,)) for t in ("fa", "fb")]
    for s in senders:
        s.start()
    ev = nx.tenant("fa").evaluate(episodes=4, version=pinned)
    try:
        wait_for(lambda: len(answers["fb"]) >= 20, 120, what="requests flowing")
        up = nx.scale_inference(2)
        assert [e["state"] for e in up["engines"]] == ["serving", "serving"]
        assert len({e["address"] for e in up["engines"]}) == 2
        n_at_2, both = sum(map(len, answers.values())), {e["engine"] for e in up["engines"]}
        # callers re-ask their route every route_ttl_s: the predictor has followed the re-routing once its
        # routes name both engines
        wait_for(lambda: {ep.engine for ep, _ in predictor._routes.values()} == both
                 and sum(map(len, answers.values())) >= n_at_2 + 40, 120, what="requests on two engines")
        routes = nx.status()["inference"]["routes"]
        assert sorted(routes.values()) == sorted(both), routes
        # from here on the predictor's routes never go stale: it leaves an engine only when that engine refuses
        # (or is gone), so the tenant on the engine scaled away must be re-sent, not failed
        predictor.route_ttl_s, resent_at_2 = float("inf"), predictor.resent
        down = nx.scale_inference(1)
        assert len(down["engines"]) == 1
        at_1 = {t: len(a) for t, a in answers.items()}
        wait_for(lambda: all(len(answers[t]) >= at_1[t] + 10 for t in answers), 120,
                 what="each tenant's requests after scale-down")
    finally:
        stop.set()
        for s in senders:
            s.join(300)
    report = ev.result(timeout=600)
    assert not errors, errors[:3]
    assert report["version"] == pinned and list(report["versions_seen"]) == [pinned]
    # every request was computed by exactly one engine: the served logs of all engines, incl. the removed one
    logs = nx.service.client.run(lambda dask_worker: list(dask_worker.plugins["nexus"].served_log))
    served = [rid for log in logs.values() for _, rid in log]
    assert len(served) == len(set(served)), "a request was answered twice"
    engines_used = {eng for log in logs.values() for eng, _ in log}
    assert len(engines_used) >= 2, engines_used
    assert predictor.resent > resent_at_2, "the removed engine's tenant was re-routed by a resend"
    st = nx.status()
    assert [o["ok"] for o in st["inference"]["operations"]][-2:] == [True, True]


# -- kills -------------------------------------------------------------------------------------------------------
def test_kill_sim_worker_mid_run(nx):
    nx.scale_inference(2)  # each tenant on its own engine from here on

    def kill():
        busy = wait_for(lambda: [w for w in nx.status()["workers"] if "SIM" in w["resources"] and w["processing"]],
                        120, 0.1, "a rollout running")
        name = busy[0]["name"]
        kill_worker(nx, name)
        return name

    _, name = _run_two_and_kill(nx, kill)
    role = _roles(nx)[f"sim/{name}"]
    assert role["restarts"] >= 1 and role["state"] == "healthy"


def test_kill_a_sim_worker_holding_a_shard_of_an_environment_session(nx):
    """A vector session spread over both simulator workers loses one: the next step is refused (503 or 404, never
    a half-stepped session), the session is gone with every shard (nothing left open on the surviving worker),
    and a new session serves once the worker is back."""
    wait_for(lambda: _all_healthy(nx), 120, 0.5, "every role healthy")
    t = nx.tenant("fa")
    venv = t.vector_env("maniskill/pushcube-state", num_envs=2, seed=0)
    venv.reset()
    venv.step(np.zeros((2, 4), np.float32))
    (row,) = nx.service.internal("nexus_env_sessions", tenant="fa")
    (kept, lost) = [sh["worker"] for sh in row["shards"]]
    kill_worker(nx, lost)
    with pytest.raises((Unavailable, NotFound)):
        venv.step(np.zeros((2, 4), np.float32))
    venv.session.closed = True
    wait_for(lambda: not nx.service.internal("nexus_env_sessions", tenant="fa"), 60, 0.5, "the session dropped")

    def sessions_here(dask_worker) -> int:  # local: sent to the worker by value
        from nexus.worker.plugin import PLUGIN_NAME

        return len(dask_worker.plugins[PLUGIN_NAME].sim.sessions.sessions)

    workers = nx.service.client.scheduler_info(n_workers=-1)["workers"]
    survivor = next(a for a, w in workers.items() if w["name"] == kept)
    wait_for(lambda: nx.service.client.run(sessions_here, workers=[survivor])[survivor] == 0, 30, 0.5,
             "the surviving shard closed")
    wait_for(lambda: _all_healthy(nx), 120, 0.5, "the simulator worker back")
    with t.vector_env("maniskill/pushcube-state", num_envs=2, seed=0) as again:
        again.reset()
        obs, *_ = again.step(np.zeros((2, 4), np.float32))
        assert obs["state"].shape == (2, 35)


def test_kill_inference_worker_mid_run(nx):
    nx.scale_inference(2)  # each tenant on its own engine (already so after the test above; alone, not yet)
    st = nx.status()
    hit_engine = st["inference"]["routes"]["fa"]
    hit_role = next(f"engine/{e['slot']}" for e in st["inference"]["engines"] if e["engine"] == hit_engine)
    restarts = _roles(nx)[hit_role]["restarts"]
    seen = {}

    def kill():
        name = worker_of_role(nx, hit_role)
        seen["fb_at_kill"] = nx.tenant("fb").version
        kill_worker(nx, name)
        wait_for(lambda: _roles(nx)[hit_role]["state"] != "healthy", 60, 0.1, "the engine seen as lost")
        wait_for(lambda: _roles(nx)[hit_role]["state"] == "healthy", 300, 0.2, "the engine restarted")
        seen["fb_at_recovery"] = nx.tenant("fb").version
        return name

    _run_two_and_kill(nx, kill)
    r = _roles(nx)[hit_role]
    assert r["restarts"] == restarts + 1 and r["epoch"] >= 2
    assert seen["fb_at_recovery"] > seen["fb_at_kill"], "the other tenant kept training while the engine restarted"
    assert len(nx.status()["inference"]["engines"]) == 2


def test_kill_actor_worker_mid_update(nx):
    lost_before = nx.status()["service"]["retried_items"]["role_lost"]

    def kill():
        kill_worker_while(nx, "actor-0", lambda: nx.status()["actor"]["running"])
        return "actor-0"

    # updates of many minibatches: the kill lands while one runs, not just after it
    _run_two_and_kill(nx, kill, ppo={"update_epochs": 12, "minibatch_size": 8})
    st = nx.status()
    assert _roles(nx)["actor/0"]["restarts"] == 1
    assert st["service"]["retried_items"]["role_lost"] >= lost_before + 1, "the interrupted update was re-run"
    for t in ("fa", "fb"):
        restores = _manifest(nx, t).get("restores", [])
        assert all(r["lost_updates"] == 0 for r in restores), restores  # checkpoint_every=1: nothing lost
    assert all(x["inflight"] == 0 for x in st["tenants"])


# -- lifecycle ----------------------------------------------------------------------------------------------------
def test_cancel_returns_admission_slots_and_the_tenant_trains_again(nx):
    t = nx.tenant("fa")
    job = t.rl(updates=50, episodes_per_batch=1, collectors=2)
    wait_for(lambda: job.info()["progress"].get("updates", 0) >= 1, 300, what="the job running")
    info = job.cancel()
    assert info["state"] == "cancelled"
    row = {x["tenant"]: x for x in nx.status()["tenants"]}["fa"]
    assert row["training_job"] is None and row["queued"] == 0
    wait_for(lambda: {x["tenant"]: x for x in nx.status()["tenants"]}["fa"]["inflight"] == 0, 60,
             what="admission slots back")
    again = t.rl(updates=1, **RL)  # accepted at once
    assert again.result(timeout=300)["updates"] == 1
    records = {p.stem: json.loads(p.read_text()) for p in (Path(row["output_dir"]) / "jobs").glob("*.json")}
    assert records[job.id]["state"] == "cancelled"


def test_a_cancelled_evaluation_leaves_no_marker_that_keeps_its_version(nx):
    t = nx.tenant("fa")
    evals = Path({x["tenant"]: x for x in nx.status()["tenants"]}["fa"]["output_dir"]) / "eval"
    job = t.evaluate(episodes=400)
    marker = evals / f"{job.id}-v{t.version:06d}.json"
    wait_for(marker.exists, 300, what="the evaluation's marker")
    assert json.loads(marker.read_text())["state"] == "running"  # retention keeps this version meanwhile
    assert job.info()["state"] == "running"
    assert job.cancel()["state"] == "cancelled"
    assert not marker.exists()  # no report will come: the version is retention's again
    done = t.evaluate(episodes=1)
    report = done.result(timeout=300)
    # a finished report stays (the tenant sees its path relative to its output dir)
    assert json.loads((evals.parent / report["report_path"]).read_text())["episodes"] == 1


def test_delete_tenant_keeps_or_purges_its_output(nx, capsys):
    from nexus.client.cli import main as cli

    out = Path({x["tenant"]: x for x in nx.status()["tenants"]}["fb"]["output_dir"])
    version = nx.tenant("fb").version
    res = nx.delete_tenant("fb")
    assert res["purged"] is False and out.exists()
    st = nx.status()
    assert "fb" not in {x["tenant"] for x in st["tenants"]} and "fb" not in st["inference"]["routes"]
    with pytest.raises(Exception, match="fb"):
        nx.service.predictor().predict("fb", _obs()).result(timeout=60)
    again = nx.create_tenant(TenantSpec(name="fb", env="maniskill/pushcube-state", seed=32))
    assert again.info["version"] == version and again.info["restored"], "re-created from the kept output dir"
    root = nx.service.config.root
    capsys.readouterr()
    assert cli(["delete", "fb", "--purge", "--root", root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["purged"] is True
    assert not out.exists()
    assert "fb" not in {x["tenant"] for x in nx.status()["tenants"]}
    assert cli(["status", "--root", root]) == 0
    printed = capsys.readouterr().out
    assert "roles" in printed and "actor/0" in printed and "healthy" in printed
