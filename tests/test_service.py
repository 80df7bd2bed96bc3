"""Integration on a real local Dask cluster: scheduler plugin, SIM/ACTOR/INFER workers,
DeepSpeed slots, ManiSkill rollouts, Arrow stores and a real MLflow store."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import pytest

from nexus.client.api import Nexus
from nexus.config.service import ServiceConfig
from nexus.config.validation import SpecError
from nexus.features import Observation
from nexus.spec import TenantSpec
from nexus.wire.dask_streams import PROMPT_S

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def nx(tmp_path_factory):
    root = tmp_path_factory.mktemp("service")
    # ops_idle_s: a low-level op session's MLflow run ends after 10 s without an op (the default is 120 s)
    # cluster.dask_config: one setting over the service's Dask defaults (checked below)
    with Nexus.local(root, n_sim=2, infer_max_wait_s=0.005, ops_idle_s=10,
                     cluster={"dask_config": {"distributed.admin.tick.interval": "750ms"}}) as nexus:
        yield nexus


def _tenants(nx: Nexus) -> list[str]:
    return [t["tenant"] for t in nx.status()["tenants"]]


def test_scheduler_process_never_imports_torch(nx):
    assert nx.service.client.run_on_scheduler(lambda: "torch" in sys.modules) is False
    assert "nexus" in nx.service.client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))


def test_service_processes_run_with_the_service_dask_settings(nx):
    """Every process of the embedded deployment reads cluster.dask_config over DASK_DEFAULTS (the idle
    service's CPU: no 10 ms stack sampling, no 20 ms loop checks)."""
    import dask

    def settings() -> tuple:
        return tuple(dask.config.get(k) for k in ("distributed.worker.profile.enabled",
                                                  "distributed.admin.tick.interval",
                                                  "distributed.worker.memory.monitor-interval"))

    want = (False, "750ms", "1s")  # two defaults and the override given above
    seen = nx.service.client.run(settings)
    assert set(seen.values()) == {want} and len(seen) >= 4
    assert nx.service.client.run_on_scheduler(settings) == want
    sampling = nx.service.client.run(lambda dask_worker: "profile" in dask_worker.periodic_callbacks)
    assert not any(sampling.values())  # the 10 ms stack sampling is really off, not only configured off
    # the nanny's pre-spawn environment without Dask's MALLOC_TRIM_THRESHOLD_=65536 (glibc's own thresholds,
    # unless this process's environment sets one), with the rest of it kept
    def environ() -> tuple:
        return os.environ.get("MALLOC_TRIM_THRESHOLD_"), os.environ.get("OPENBLAS_NUM_THREADS")

    mine = (os.environ.get("MALLOC_TRIM_THRESHOLD_"), os.environ.get("OPENBLAS_NUM_THREADS", "1"))
    assert set(nx.service.client.run(environ).values()) == {mine}


def test_the_control_planes_dask_streams_send_promptly(nx):
    """Dask batches a stream's messages 2-10 ms apart; the control plane's tasks (one on each job's next step) are
    sent, started and reported within PROMPT_S of the message before."""

    async def control_streams(dask_scheduler) -> dict[str, list[float]]:
        # its master's client's stream to the scheduler and the scheduler's back to it; the scheduler's to each worker
        client = await dask_scheduler.plugins["nexus"].master.runtime.client()
        return {"client": [client.scheduler_comm.interval, dask_scheduler.client_comms[client.id].interval],
                "workers": [s.interval for s in dask_scheduler.stream_comms.values()]}

    streams = nx.service.client.run_on_scheduler(control_streams)
    assert streams["client"] == [PROMPT_S, PROMPT_S]
    assert len(streams["workers"]) >= 3 and set(streams["workers"]) == {PROMPT_S}  # actor, inference, SIM workers
    to_scheduler = nx.service.client.run(lambda dask_worker: dask_worker.batched_stream.interval)
    assert set(to_scheduler.values()) == {PROMPT_S}
    # this test's own client is not the control plane's: Dask's batching as before
    assert nx.service.client.scheduler_comm.interval > PROMPT_S


def test_cpu_seconds_name_every_process_of_the_service(nx):
    """LocalService.cpu_seconds (what the benchmarks read): every spawned process by its name, a worker's
    nanny apart, and CPU time only grows."""
    before = nx.service.cpu_seconds()
    workers = {str(i["name"]) for i in nx.service.client.scheduler_info()["workers"].values()}
    assert set(before) == {"scheduler", "gateway", "nannies", *workers}
    assert {"actor-0", "infer-0", "sim-0", "sim-1"} <= workers and all(v > 0 for v in before.values())
    nx.service.client.run(lambda: sum(i * i for i in range(2_000_000)), workers=[
        a for a, i in nx.service.client.scheduler_info()["workers"].items() if i["name"] == "sim-0"])
    after = nx.service.cpu_seconds()
    assert all(after[k] >= before[k] for k in before) and after["sim-0"] > before["sim-0"]


@pytest.mark.parametrize("spec, message", [
    (dict(name="bad-env", env="maniskill/no-such-task"), "unknown env"),
    (dict(name="bad-dims", env="maniskill/pushcube-state", action_dim=7), "action_dim=7"),
    (dict(name="bad-limit", env="maniskill/pushcube-state", max_inflight=-1), "max_inflight"),
    (dict(name="bad-stale", env="maniskill/pushcube-state", max_staleness=-3), "max_staleness"),
    (dict(name="needs-dl", env="maniskill/PickSingleYCB"), "download"),
    (dict(name="Bad Name!", env="maniskill/pushcube-state"), "name"),
])
def test_invalid_spec_rejected_and_no_slot_taken(nx, spec, message):
    before = _tenants(nx)
    with pytest.raises(SpecError, match=message):
        nx.create_tenant(spec)
    assert _tenants(nx) == before


def test_rl_versions_advance_and_trajectories_carry_versions(nx):
    from nexus.data.output_dir import TenantOutputDir
    from nexus.data.trajectory_store import TrajectoryStore
    from nexus.features import TenantSchema

    # fixed 50-step episodes, so the row count below holds on any CPU
    t = nx.create_tenant(TenantSpec(name="rl-a", env="maniskill/pushcube-state-full", action_dim=4, seed=5))
    v0 = t.version
    res = t.rl(updates=3, episodes_per_batch=1, collectors=2).result(timeout=600)
    assert res["updates"] == 3 and res["version"] == v0 + 3 == t.version
    out = TenantOutputDir(t.info["output_dir"])
    schema = TenantSchema.from_dict(json.loads(out.manifest_path.read_text())["schema"])
    table = TrajectoryStore(out.trajectories, "rl-a", schema).scan()
    versions = set(table.column("policy_version").to_pylist())
    assert versions and versions <= set(range(v0, v0 + 3))
    assert table.num_rows >= 3 * 50
    manifest = json.loads(out.manifest_path.read_text())
    assert manifest["latest_version"] == v0 + 3
    assert manifest["jobs"][-1]["state"] == "done" and manifest["checkpoints"]


def test_a_batch_split_over_two_rollout_tasks_trains_as_one(nx):
    from nexus.data.output_dir import TenantOutputDir
    from nexus.data.trajectory_store import TrajectoryStore
    from nexus.features import TenantSchema

    # fixed 50-step episodes: with the catalog's end at success, a lucky push shortens one (358 steps on one CPU)
    t = nx.create_tenant(TenantSpec(name="rl-split", env="maniskill/pushcube-state-full", action_dim=4, seed=7,
                                    max_inflight=1))
    job = t.rl(updates=2, episodes_per_batch=4, collectors=1, split=2)
    res = job.result(timeout=600)
    assert res["updates"] == 2 and res["episodes"] == 8 and res["env_steps"] == 8 * 50
    assert [h["batch_steps"] for h in _history(nx, job.id) if "batch_steps" in h] == [200.0, 200.0]  # one batch
    out = TenantOutputDir(t.info["output_dir"])
    schema = TenantSchema.from_dict(json.loads(out.manifest_path.read_text())["schema"])
    store = TrajectoryStore(out.trajectories, "rl-split", schema)
    assert len(store.batches()) == 4  # two stored parts per batch
    episodes = store.scan().column("episode").to_numpy()
    assert sorted(set(episodes)) == list(range(8)) and len(episodes) == 8 * 50  # each episode once, whole


def test_an_annealed_ppo_job_steps_each_update_at_its_share_of_the_tenants_learning_rate(nx):
    t = nx.create_tenant(TenantSpec(name="rl-anneal", env="maniskill/pushcube-state-full", action_dim=4, seed=8,
                                    lr=1e-3, max_inflight=1))
    job = t.rl(updates=3, episodes_per_batch=1, collectors=1, ppo={"anneal_lr": True, "minibatch_size": 25})
    assert job.result(timeout=600)["updates"] == 3
    lrs = [h["lr"] for h in _history(nx, job.id) if "batch_steps" in h]
    assert lrs == pytest.approx([1e-3, 1e-3 * 2 / 3, 1e-3 / 3])  # CleanRL's linear schedule, 1 - i / n
    # the tenant's own rate is untouched: a plain job after it steps at 1e-3 again
    plain = t.rl(updates=1, episodes_per_batch=1, collectors=1, ppo={"minibatch_size": 25})
    plain.result(timeout=600)
    assert [h["lr"] for h in _history(nx, plain.id) if "batch_steps" in h] == pytest.approx([1e-3])


def test_stale_batches_dropped_and_counted(nx):
    t = nx.create_tenant(TenantSpec(name="rl-stale", env="maniskill/pushcube-state", action_dim=4,
                                    max_staleness=0, max_inflight=2, seed=6))
    res = t.rl(updates=2, episodes_per_batch=1, collectors=2).result(timeout=600)
    assert res["updates"] == 2
    assert res["dropped_stale"] >= 1
    st = {x["tenant"]: x for x in nx.status()["tenants"]}["rl-stale"]
    assert st["dropped_stale"] == res["dropped_stale"]
    assert st["max_inflight_seen"] <= 2


def test_sft_loss_falls_and_eval_pins_version_while_training(nx):
    t = nx.create_tenant(TenantSpec(name="sft-a", dataset="pickcube-scripted", env="maniskill/pickcube-state",
                                    action_dim=4, lr=1e-3, seed=7))
    warm = t.sft(steps=3, batch_size=32).result(timeout=300)
    pinned = warm["version"]
    job = t.submit({"kind": "sft", "steps": 40, "batch_size": 32})
    ev = t.evaluate(episodes=2, version=pinned)
    report = ev.result(timeout=600)
    res = job.result(timeout=600)
    assert report["version"] == pinned and list(report["versions_seen"]) == [pinned]
    assert res["version"] > pinned, "training went on while the evaluation ran"
    assert 0.0 <= report["success_rate"] <= 1.0
    losses = [h["loss"] for h in _history(nx, job.id) if "loss" in h]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses


def _history(nx: Nexus, job_id: str) -> list[dict]:
    return nx.service.client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.plugins["nexus"].jobs[job_id].history)


def test_eval_creates_no_training_queue_entries(nx):
    t = nx.create_tenant(TenantSpec(name="eval-only", env="maniskill/pushcube-state", action_dim=4, seed=8))
    before = {x["tenant"]: x for x in nx.status()["tenants"]}["eval-only"]
    dispatched = nx.service.client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.plugins["nexus"].queue.counters["eval-only"].dispatched)
    res = t.evaluate(episodes=2).result(timeout=300)
    assert res["version"] == before["version"] and res["episodes"] == 2
    after = nx.service.client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.plugins["nexus"].queue.counters["eval-only"].dispatched)
    assert after == dispatched == 0


def test_low_level_api_futures(nx):
    from nexus.config import catalog
    from nexus.data.offline_dataset import OfflineDataset

    t = nx.create_tenant(TenantSpec(name="tinker", dataset="pickcube-scripted", action_dim=4, seed=9))
    ds = OfflineDataset(catalog.dataset("pickcube-scripted"))
    batch = ds.sample_batch(16, step=0, seed=0)
    obs = ds.observations(batch)
    v0 = t.version
    f1 = t.forward_backward({"observations": obs, "actions": batch["action"]}, loss="sft")
    f2 = t.forward_backward({"observations": obs, "actions": batch["action"]}, loss="sft")
    f3 = t.optim_step()
    f4 = t.save_weights()
    l1, l2 = f1.result(120)["metrics"]["loss"], f2.result(120)["metrics"]["loss"]
    assert l1 == pytest.approx(l2)  # no step between them: same weights, same loss
    f3.result(120)
    assert f4.result(120) == v0 + 1 == t.version
    out = t.predict_action(obs[0]).result()
    assert out["action"].shape == (4,) and out["version"] == v0 + 1
    after = t.forward_backward({"observations": obs, "actions": batch["action"]}).result(120)
    assert after["metrics"]["loss"] < l1
    with pytest.raises(SpecError, match="unknown op|loss"):
        nx.transport.op("tinker", "forward_backward", body={"batch": None, "loss": "bogus"})


def _ops_runs(client, experiment: str, tenant: str) -> dict[str, object]:
    """The ops runs of ``tenant`` by run key (tag ``nexus.job``)."""
    exp = client.get_experiment_by_name(experiment)
    found = client.search_runs([exp.experiment_id],
                               filter_string=f"tags.`nexus.kind` = 'ops' and tags.`nexus.tenant` = '{tenant}'")
    return {r.data.tags["nexus.job"]: r for r in found}


def _wait_ended(nx: Nexus, client, tenant: str, n: int, timeout: float = 180.0) -> dict[str, object]:
    deadline = time.time() + timeout
    while True:
        nx.flush()
        runs = _ops_runs(client, nx.service.config.resolved_experiment(), tenant)
        if sum(r.info.status == "FINISHED" for r in runs.values()) >= n or time.time() > deadline:
            return runs
        time.sleep(1.0)


def _result(client, run, tmp_path) -> dict:
    path = client.download_artifacts(run.info.run_id, "result.json", str(tmp_path / run.info.run_id))
    return json.loads(open(path).read())


def test_low_level_ops_one_mlflow_run_per_client_connection(nx, tmp_path):
    """Two clients (two Nexus instances on the gateway, one tenant's token) doing ops on one tenant: two runs
    with their ops' metrics at monotonic steps, ending after idle; a later op opens a new run, which ends when
    the service ends its sessions (as it stops) or when the tenant is deleted."""
    import httpx
    from mlflow.tracking import MlflowClient

    from nexus.client.api import Tenant
    from nexus.config import catalog
    from nexus.data.offline_dataset import OfflineDataset
    from nexus.spec import SESSION_HEADER

    name = "ops-two"
    nx.create_tenant(TenantSpec(name=name, dataset="pickcube-scripted", action_dim=4, seed=11))
    token, url = nx.tokens[name], nx.service.gateway_url
    ds = OfflineDataset(catalog.dataset("pickcube-scripted"))
    batch = ds.sample_batch(8, step=0, seed=0)
    data = {"observations": ds.observations(batch), "actions": batch["action"]}
    client = MlflowClient(tracking_uri=nx.service.config.resolved_tracking_uri())
    a, b, c = (Nexus(url, token=token) for _ in range(3))
    try:
        assert len({a.session, b.session, c.session}) == 3
        ta, tb, tc = (Tenant(x, name, {}) for x in (a, b, c))
        t0 = time.time()
        # one slot: gradients accumulate across sessions, so each client steps right after its backward
        la = [ta.forward_backward(data).result(120)["metrics"]["loss"]]
        ta.optim_step().result(120)
        lb = [tb.forward_backward(data).result(120)["metrics"]["loss"]]
        tb.optim_step().result(120)
        la.append(ta.forward_backward(data).result(120)["metrics"]["loss"])
        va = ta.save_weights().result(120)
        lb.append(tb.forward_backward(data).result(120)["metrics"]["loss"])
        tb.optim_step().result(120)
        t1 = time.time()
        # a bad session id: refused (422) before anything runs
        r = httpx.post(f"{url}/v1/tenants/{name}/optim_step",
                       headers={"Authorization": f"Bearer {token}", SESSION_HEADER: "not a token!"})
        assert r.status_code == 422 and r.json()["error"]["class"] == "SpecError"

        runs = _wait_ended(nx, client, name, 2)  # both idle
        assert len(runs) == 2 and all(x.info.status == "FINISHED" for x in runs.values())
        by_session = {x.data.tags["nexus.session"]: x for x in runs.values()}
        ra, rb = by_session[a.session], by_session[b.session]
        assert ra.info.run_name == f"{name}-ops-{a.session[:8]}" and rb.info.run_name == f"{name}-ops-{b.session[:8]}"
        for run, losses, n_ops, n_steps in ((ra, la, 4, 1), (rb, lb, 4, 2)):
            hist = client.get_metric_history(run.info.run_id, "train/loss")
            assert [m.value for m in hist] == pytest.approx(losses)
            steps = [m.step for m in hist]
            assert steps == sorted(set(steps)), steps  # strictly growing
            grads = client.get_metric_history(run.info.run_id, "train/grad_norm")
            assert len(grads) == n_steps and not {g.step for g in grads} & set(steps)
            # start = the first op, end = the last op (not when the idle check ended it)
            assert t0 * 1000 - 1 <= run.info.start_time < run.info.end_time <= t1 * 1000 + 1
            assert {k: _result(client, run, tmp_path)[k] for k in ("ended", "ops")} == {"ended": "idle", "ops": n_ops}
        assert [m.value for m in client.get_metric_history(ra.info.run_id, "train/published_version")] == [va]
        assert ra.data.tags["nexus.version"] == str(va)
        assert [x.path for x in client.list_artifacts(ra.info.run_id, "weights")] == [f"weights/v{va:06d}.pt"]

        tc.forward_backward(data).result(120)  # a third client: ended as a stopping service ends its sessions
        nx.service._end_sessions()
        tb.forward_backward(data).result(120)  # client b again, after its idle end: a new run
        nx.delete_tenant(name)
        runs = _wait_ended(nx, client, name, 4)
        assert len(runs) == 4 and all(x.info.status == "FINISHED" for x in runs.values())
        rc = next(x for x in runs.values() if x.data.tags["nexus.session"] == c.session)
        rb2 = next(x for k, x in runs.items() if x.data.tags["nexus.session"] == b.session
                   and k != rb.data.tags["nexus.job"])
        assert _result(client, rc, tmp_path)["ended"] == "service closing"
        assert _result(client, rb2, tmp_path)["ended"] == "tenant deleted"
        assert rb2.info.start_time > rb.info.end_time
    finally:
        for x in (a, b, c):
            x.close()


def test_mlflow_one_run_per_job(nx):
    from mlflow.tracking import MlflowClient

    from nexus.tracking.tracker import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG

    # jobs of its own (with those the module's other tests left, if they ran): it runs alone too
    sft = nx.create_tenant(TenantSpec(name="runs-sft", dataset="pickcube-scripted", env="maniskill/pickcube-state",
                                      action_dim=4, seed=21))
    sft.sft(steps=2, batch_size=8).result(timeout=300)
    sft.evaluate(episodes=1).result(timeout=300)
    rl = nx.create_tenant(TenantSpec(name="runs-rl", env="maniskill/pushcube-state", action_dim=4, seed=22))
    rl.rl(updates=1, episodes_per_batch=1, collectors=1).result(timeout=600)
    nx.flush()
    st = nx.status()
    jobs = [j for j in st["jobs"] if j["state"] in ("done", "failed")]
    client = MlflowClient(tracking_uri=f"sqlite:///{st['config']['root']}/mlflow.db")
    exp = client.get_experiment_by_name(ServiceConfig(**st["config"]).resolved_experiment())
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND  # MLflow 3 shows a training view, not GenAI
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    by_job = {}
    for r in runs:
        by_job.setdefault(r.data.tags["nexus.job"], []).append(r)
    for j in jobs:
        assert len(by_job.get(j["job"], [])) == 1, j["job"]
        run = by_job[j["job"]][0]
        assert run.data.params["name"] == j["tenant"]
        assert run.info.status == ("FINISHED" if j["state"] == "done" else "FAILED")
        # the run lasts as long as the job did: it starts when the job was submitted and ends when the job ended
        assert (run.info.start_time, run.info.end_time) == (int(j["t_submit"] * 1000), int(j["t_end"] * 1000)), j
        assert not [k for k in run.data.metrics if "/" not in k], run.data.metrics.keys()  # all namespaced
        for key in run.data.metrics:  # one point per step, steps growing in logging order: no zig-zag
            steps = [m.step for m in sorted(client.get_metric_history(run.info.run_id, key),
                                            key=lambda m: m.timestamp)]
            assert steps == sorted(set(steps)), (j["job"], key, steps)
    sft_runs = [by_job[j["job"]][0] for j in jobs if j["kind"] == "sft"]
    assert any("train/loss" in r.data.metrics for r in sft_runs)
    rl_runs = [by_job[j["job"]][0] for j in jobs if j["kind"] == "rl"]
    assert rl_runs and all({"rollout/return", "rollout/policy_version", "train/loss", "system/update_s"}
                           <= set(r.data.metrics) for r in rl_runs)
    # the evaluation of runs-sft is nested under runs-sft's training run, and carries the weights it evaluated
    evals = [(j, by_job[j["job"]][0]) for j in jobs if j["kind"] == "eval" and j["tenant"] == "runs-sft"]
    parents = {r.data.tags.get("mlflow.parentRunId") for _, r in evals}
    assert parents and parents <= {by_job[j["job"]][0].info.run_id for j in jobs
                                   if j["tenant"] == "runs-sft" and j["kind"] == "sft"}
    for j, r in evals:
        version = j["result"]["version"]
        assert "eval/success_rate" in r.data.metrics and r.data.tags["nexus.version"] == str(version)
        weights = [a.path for a in client.list_artifacts(r.info.run_id, "weights")]
        assert weights == [f"weights/v{version:06d}.pt"], (version, weights)
    for j in jobs:  # a training run carries the version it produced
        if j["kind"] in ("sft", "rl") and j["state"] == "done":
            run = by_job[j["job"]][0]
            weights = [a.path for a in client.list_artifacts(run.info.run_id, "weights")]
            assert weights == [f"weights/v{j['result']['version']:06d}.pt"], weights


def test_predict_observation_goes_direct_to_engine(nx):
    t = nx.create_tenant(TenantSpec(name="direct", env="maniskill/pushcube-state", seed=13))
    obs = Observation(state=np.zeros(35, np.float32), instruction="push")
    out = t.predict_action(obs, deterministic=True).result(timeout=60)
    assert out["action"].shape == (4,) and out["version"] == t.version


def test_state_route_and_cli_status(nx, capsys):
    import urllib.request

    from nexus.client.cli import main

    nx.create_tenant(TenantSpec(name="probe", env="maniskill/pushcube-state", seed=12))
    url = nx.service.dashboard_link.replace("/status", "/nexus/api/state")
    state = json.loads(urllib.request.urlopen(url, timeout=30).read())
    assert "probe" in {t["tenant"] for t in state["tenants"]}
    assert main(["status", "--root", nx.service.config.root, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {t["tenant"] for t in printed["tenants"]} == {t["tenant"] for t in state["tenants"]}
    assert main(["status", "--root", nx.service.config.root]) == 0
    assert "probe" in capsys.readouterr().out
