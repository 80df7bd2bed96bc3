"""Tinker parity and GRPO as a job, through the gateway of one live service (real Dask, DeepSpeed, ManiSkill, HTTP,
MLflow): ``save_state`` / ``load_state`` bring back the head *and* its optimizer state, ``optim_step(adam=...)``
applies to one step only, ``forward`` gives the log-probs the inference engine gave the same action, predict
samples reproducibly with a seed and ``n`` at once, an ``RLJob(algorithm="grpo")`` with a KL reference runs, and
closing the service right after a job ends leaves that job's MLflow run as its record says (not RUNNING)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nexus.client.api import Nexus
from nexus.client.futures import NexusFuture
from nexus.errors import Conflict, NotFound, SpecError
from nexus.features import Observation
from nexus.spec import AdamParams, TenantSpec

pytestmark = pytest.mark.cluster

PUSH = "maniskill/pushcube-state"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker")
    nx = Nexus.local(root, n_sim=1)
    state = {"nx": nx, "closed": False, "root": Path(nx.service.config.root)}
    try:
        state["t"] = nx.create_tenant(TenantSpec(name="tk", env=PUSH, hidden_dim=32, lr=1e-2, seed=5))
        yield state
    finally:
        if not state["closed"]:
            nx.close()


def _batch(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"observations": [Observation(state=rng.standard_normal(35).astype(np.float32)) for _ in range(n)],
            "actions": rng.uniform(-1, 1, (n, 4)).astype(np.float32)}


def _step(t, batch, adam=None) -> dict:
    t.forward_backward(batch).result(300)
    return t.optim_step(adam).result(300)


def test_save_and_load_state_bring_back_the_weights_and_the_optimizer_state(env):
    t = env["t"]
    probe, b1, b2 = _batch(6, 0), _batch(8, 1), _batch(8, 2)
    _step(t, b1)  # the optimizer has moments to save
    assert t.save_state("after-one").result(300)["metrics"]["state_bytes"] > 0
    at_save = np.array(t.forward(probe).result(300)["logprobs"])
    _step(t, b2)
    once = np.array(t.forward(probe).result(300)["logprobs"])
    assert np.abs(once - at_save).max() > 1e-4  # the step moved the head
    version = t.version
    t.load_state("after-one").result(300)
    np.testing.assert_allclose(t.forward(probe).result(300)["logprobs"], at_save, rtol=1e-5, atol=1e-5)
    assert t.version == version  # a state is not a version: nothing went back
    _step(t, b2)  # the same step from the restored optimizer state (Adam's moments) lands where it did
    np.testing.assert_allclose(t.forward(probe).result(300)["logprobs"], once, rtol=1e-4, atol=1e-4)
    assert t.save_weights().result(300) == version + 1  # the loaded-and-stepped weights, a new version

    with pytest.raises(NotFound, match="no saved state 'nope'"):
        t.load_state("nope").result(300)
    with pytest.raises(SpecError, match="state name"):
        t.load_state("../x").result(300)
    t.forward_backward(b1).result(300)
    with pytest.raises(Conflict, match="wait for an optim_step"):
        t.load_state("after-one").result(300)
    t.optim_step().result(300)
    assert (env["root"] / "tenants" / "tk" / "states" / "after-one").is_dir()


def test_optim_step_adam_params_apply_to_that_step_only(env):
    t = env["t"]
    probe, b = _batch(6, 3), _batch(8, 4)
    before = np.array(t.forward(probe).result(300)["logprobs"])
    out = _step(t, b, AdamParams(learning_rate=1e-9, beta1=0.5))
    assert out["metrics"]["lr"] == pytest.approx(1e-9)
    after = np.array(t.forward(probe).result(300)["logprobs"])
    assert np.abs(after - before).max() < 1e-3  # a step of 1e-9 barely moves anything
    out = _step(t, b)
    assert out["metrics"]["lr"] == pytest.approx(1e-2)  # back to the tenant's own
    assert np.abs(np.array(t.forward(probe).result(300)["logprobs"]) - after).max() > 1e-3
    t.forward_backward(b).result(300)
    with pytest.raises(SpecError, match="adam"):
        t.optim_step({"learning_rate": -1.0})
    t.optim_step().result(300)


def test_forward_gives_the_log_probs_the_engine_sampled_with_and_predict_samples_reproducibly(env):
    t = env["t"]
    t.save_weights().result(300)  # the engine serves the slot's current weights
    obs = _batch(1, 7)["observations"][0]
    a = t.predict_action(obs, deterministic=False, seed=11).result(300)
    b = t.predict_action(obs, deterministic=False, seed=11).result(300)
    c = t.predict_action(obs, deterministic=False, seed=12).result(300)
    np.testing.assert_allclose(a["action"], b["action"], atol=1e-6)
    assert np.abs(a["action"] - c["action"]).max() > 1e-4
    many = t.predict_action(obs, deterministic=False, seed=11, n=5).result(300)
    assert np.asarray(many["actions"]).shape == (5, 4) and len(many["logprobs"]) == 5
    np.testing.assert_allclose(many["actions"][0], a["action"], atol=1e-5)
    assert len({round(float(x), 5) for x in many["logprobs"]}) == 5
    # the actor's forward on its unsaved-equal weights gives the engine's log-probs of the same actions
    # (actions within [-1, 1]: the engine answers the unclipped sample's clipped copy)
    actions = np.asarray(many["actions"], np.float32)
    inside = np.all(np.abs(actions) < 1, axis=1)
    got = t.forward({"observations": [obs] * 5, "actions": actions}).result(300)
    np.testing.assert_allclose(np.array(got["logprobs"])[inside], np.array(many["logprobs"])[inside], atol=1e-3)
    assert len(got["values"]) == len(got["entropies"]) == 5
    with pytest.raises(SpecError, match="deterministic"):
        t.predict_action(obs, seed=1)
    assert isinstance(t.forward(_batch(1, 8)), NexusFuture)


def test_grpo_job_with_a_kl_reference_and_an_annealed_learning_rate(env):
    t = env["t"]
    job = t.rl(algorithm="grpo", updates=2, episodes_per_batch=4, collectors=1,
               grpo={"group_size": 2, "kl_coef": 0.1, "update_epochs": 2, "minibatch_size": 64, "anneal_lr": True})
    res = job.result(timeout=900)
    assert res["updates"] == 2
    train = [r for r in job.info().get("history", []) if r.get("kind") == "train"] or [
        r for j in env["nx"].tenant_log("tk")["jobs"] if j["job"] == job.id
        for r in j["history"] if r.get("kind") == "train"]
    assert len(train) == 2 and all("kl_ref" in r and "group_return_std" in r for r in train)
    assert [r["lr"] for r in train] == pytest.approx([1e-2, 1e-2 / 2])  # update i of n at the tenant's lr x (1 - i/n)
    assert train[-1]["kl_ref"] > 0  # the head moved away from the version the job started from
    markers = [json.loads(p.read_text()) for p in (env["root"] / "tenants" / "tk" / "eval").glob(f"{job.id}-*")]
    assert not [m for m in markers if m.get("state") == "running"]  # the reference is no longer kept for it


def test_closing_right_after_a_job_leaves_its_run_as_recorded(env):
    """Closing waits for a job that just ended to record itself and flushes the tracker: its MLflow run is
    FINISHED, not RUNNING (nor FAILED at the next start)."""
    from mlflow.tracking import MlflowClient

    nx, t = env["nx"], env["t"]
    job = t.evaluate(episodes=1)
    assert {j["job"]: j["kind"] for j in nx.status(tenant="tk")["jobs"]}[job.id] == "eval"  # the service has it
    info = nx.transport.wait(job.id, timeout=300)  # returns as soon as the job's state is final
    assert info["state"] == "done"
    cfg = nx.service.config
    nx.close()
    env["closed"] = True
    record = json.loads((env["root"] / "tenants" / "tk" / "jobs" / f"{job.id}.json").read_text())
    client = MlflowClient(tracking_uri=cfg.resolved_tracking_uri())
    exp = client.get_experiment_by_name(cfg.resolved_experiment())
    runs = {r.data.tags.get("nexus.job"): r for r in client.search_runs([exp.experiment_id], max_results=100)}
    assert record["state"] == "done" and runs[job.id].info.status == "FINISHED"
    assert not [j for j, r in runs.items() if r.info.status == "RUNNING"], "a run was left RUNNING at close"
