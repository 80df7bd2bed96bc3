"""RL through the service's own simulators learns: a PushCube tenant's PPO job, run by a real local service
(scheduler plugin, SIM workers, actor, inference engine), must raise the deterministic evaluation return of
its policy above that of its start by a stated margin; an evaluation reports what its policy scores; and a
flow-matching (π) tenant trains by PPO and GRPO, its export acting deterministically."""

from __future__ import annotations

import math
import os
from typing import Any

import httpx
import numpy as np
import pytest

from nexus.client.api import Nexus
from nexus.export import policy as exported
from nexus.features import Observation
from nexus.spec import TenantSpec

pytestmark = pytest.mark.cluster

ENV = "maniskill/pushcube-state-full"  # fixed 50-step episodes with the dense reward: the return measures learning
SEED = 1  # the test's seed; calibrated on others (see test_ppo_through_the_service_beats_its_start)
UPDATES = 8
EPISODES = 16  # per update, as configs/demo/push-rl.toml
EVAL_EPISODES = 16
MARGIN = 2.0  # mean evaluation return (sum of normalized dense rewards over 50 steps) over the start's:
# under half the smallest gain of the calibration seeds (4.49); the two broken updates tried gave -3.43 and -0.04


def tenant_spec(name: str, seed: int) -> TenantSpec:
    """configs/demo/push-rl.toml's tenant."""
    return TenantSpec(name=name, env=ENV, action_head="oft", lr=5e-4, grad_clip=0.5, max_inflight=1,
                      proprio_norm="running", seed=seed)


def rl_job(updates: int) -> dict[str, Any]:
    """configs/demo/push-rl.toml's job, ``updates`` long, without the lr annealing (a short job)."""
    return {"kind": "rl", "updates": updates, "episodes_per_batch": EPISODES, "collectors": 1, "split": 2,
            "ppo": {"gamma": 0.8, "gae_lambda": 0.9, "update_epochs": 8, "minibatch_size": 200,
                    "target_kl": 0.1}}


def learn(nx: Nexus, name: str, seed: int, updates: int = UPDATES) -> dict[str, Any]:
    """The tenant's deterministic evaluation (same episode seeds each time) before and after ``updates`` PPO
    updates, with the job's rollout returns."""
    t = nx.create_tenant(tenant_spec(name, seed))
    before = t.evaluate(episodes=EVAL_EPISODES).result(timeout=600)
    res = t.submit(rl_job(updates)).result(timeout=1200)
    after = t.evaluate(episodes=EVAL_EPISODES).result(timeout=600)
    log = nx.tenant_log(name)
    rollouts = [round(float(r["return"]), 2) for j in log["jobs"] if j["kind"] == "rl"
                for r in j.get("history", []) if r.get("kind") == "rollout"]
    return {"before": before, "after": after, "result": res, "rollout_returns": rollouts}


@pytest.fixture(scope="module")
def nx(tmp_path_factory):
    with Nexus.local(tmp_path_factory.mktemp("learning"), n_sim=2) as nexus:
        yield nexus


@pytest.fixture(scope="module")
def learned(nx) -> dict[str, Any]:
    out = learn(nx, "learner", SEED)
    print(f"learning figures (seed {SEED}): return {out['before']['mean_return']:.2f} -> "
          f"{out['after']['mean_return']:.2f}, rollouts {out['rollout_returns']}")  # shown with pytest -s
    return out


def test_ppo_through_the_service_beats_its_start(learned):
    """8 PPO updates of 16 PushCube episodes through the service raise the policy's deterministic evaluation
    return (16 episodes on the evaluation's fixed seeds) by at least MARGIN over its version 0.

    Calibration, once, on seeds other than SEED (`python tests/test_rl_learning.py 2 3 4`: one service, the
    three tenants one after another, 2 shared cores), mean evaluation return at version 0 -> version 8:

    | seed | before | after | gain | eval success | rollout returns, updates 1-8 |
    |---:|---:|---:|---:|---|---|
    | 2 | 3.57 | 8.07 | +4.49 | 0.00 -> 0.00 | 2.61 2.85 4.86 8.15 6.01 10.37 6.53 10.59 |
    | 3 | 3.49 | 10.64 | +7.15 | 0.00 -> 0.12 | 2.37 3.88 4.49 6.36 10.60 7.92 6.07 13.63 |
    | 4 | 3.73 | 8.44 | +4.70 | 0.00 -> 0.00 | 2.97 3.25 3.95 6.46 7.88 8.85 7.04 6.52 |

    SEED itself, in the test: 3.75 -> 8.10 and 3.75 -> 7.55 in two runs (the service's RL is not bitwise
    repeatable: which rows share an engine batch depends on timing). MARGIN (2.0) is under half the smallest
    calibration gain. Wall time: ~2 min per seed with the calibration's service already up; the whole module
    (start, learning, both tests) 6.3 min on 2 cores shared with 7 other sessions (load ~16).

    Broken on purpose once each (in a copy of the tree), on SEED: PPO's advantage sign flipped in ``ppo_loss``
    -> 3.75 to 0.32 (gain -3.43; rollout returns 2.13 1.98 1.31 0.89 0.64 0.45 ...): fails; every optimizer
    step at lr 0 (``TenantSlot.optim_step``) -> 3.75 to 3.70 (gain -0.04; the running state normalization
    still moves): fails."""
    before, after = learned["before"], learned["after"]
    assert learned["result"]["updates"] == UPDATES and after["version"] == before["version"] + UPDATES
    assert before["episodes"] == after["episodes"] == EVAL_EPISODES
    gain = after["mean_return"] - before["mean_return"]
    assert gain >= MARGIN, (before["mean_return"], after["mean_return"], learned["rollout_returns"])


def replay(t, version: int, seeds: list[int]) -> tuple[list[float], list[bool]]:
    """Each episode's return and success under ``version``'s deterministic actions, driven here through an
    environment session, one predict per step: the episodes an evaluation with these seeds runs."""
    returns, successes = [], []
    with t.env(ENV) as env:
        for seed in seeds:
            obs, _ = env.reset(seed=seed)
            total, success = 0.0, False
            for _ in range(env.max_episode_steps):
                out = t.predict_action(Observation(state=obs["state"], instruction=env.instruction),
                                       version=version, deterministic=True).result(60)
                obs, reward, terminated, truncated, info = env.step(out["action"])
                total, success = total + reward, success or info["success"]
                if terminated or truncated:
                    break
            returns.append(total)
            successes.append(success)
    return returns, successes


def test_an_evaluation_reports_what_its_policy_scores(nx, learned):
    """An evaluation job's success rate and mean return are those of the policy it evaluates, known here by
    replaying that version on the evaluation's own episode seeds (``7_000_003 * (1 + tenant seed) + i``,
    nexus.control.jobs.flows)."""
    t, version = nx.tenant("learner"), learned["after"]["version"]
    first = 7_000_003 * (1 + SEED)
    # one episode: one simulator task whose rows reach the engine one at a time, as the replay's do: the same
    # arithmetic, the same episode
    one = t.evaluate(episodes=1, version=version).result(timeout=600)
    returns, successes = replay(t, version, [first])
    assert (one["version"], one["episodes"], one["steps"]) == (version, 1, 50)  # fixed 50-step episodes
    # usually bit-equal; a run in five differed (the engine's batching of the lone rows is not guaranteed): within 10 %
    assert one["mean_return"] == pytest.approx(returns[0], rel=0.10), (one, returns)
    # four on two simulator tasks at once: their rows share engine batches, whose sums may differ from a lone
    # row's in the last bits, and 50 steps of contact grow that (seen: 7.519 vs 7.543 replayed, and 13.14 vs 13.44
    # in a fresh clone): the four episodes' figures agree with the replay within one episode's flip of success and
    # 10 % of the mean return, far tighter than another version's score (version 0 returns ~3.6 here)
    four = t.evaluate(episodes=4, version=version).result(timeout=600)
    returns, successes = replay(t, version, [first + i for i in range(4)])
    assert (four["episodes"], four["steps"]) == (4, 200)
    assert abs(four["success_rate"] - np.mean(successes)) <= 0.25 + 1e-9, (four, successes)
    assert four["mean_return"] == pytest.approx(np.mean(returns), rel=0.10), (four, returns)


def test_ppo_and_grpo_train_a_pi_tenant_whose_export_acts_deterministically(nx, tmp_path):
    """RL for a flow-matching family: a π-head tenant's PPO and GRPO jobs run and change its policy; the
    log-probability the engine reports for a sampled action is the one the actor recomputes (``forward``); the
    exported policy acts deterministically, as the service's deterministic predict does. (How well such a tenant
    learns: ``experiments/flow_rl``.)"""
    t = nx.create_tenant(TenantSpec(name="pi-rl", env=ENV, action_head="pi", hidden_dim=32, seed=SEED))
    obs = Observation(state=np.linspace(-0.5, 0.5, 35).astype(np.float32), instruction="push the cube")
    v0 = t.predict_action(obs).result(60)["action"]

    # the engine's sample and its log-probability; the actor's recomputation of it, on the same weights
    sample = t.predict_action(obs, deterministic=False, seed=7).result(60)
    again = t.forward({"observations": [{"state": obs.state, "instruction": obs.instruction}],
                       "actions": [sample["action"]]}).result(60)
    assert math.isfinite(sample["logprob"])
    assert again["logprobs"][0] == pytest.approx(sample["logprob"], abs=1e-4)

    ppo = t.submit({"kind": "rl", "updates": 2, "episodes_per_batch": 2,
                    "ppo": {"update_epochs": 2, "minibatch_size": 50}}).result(timeout=600)
    grpo = t.submit({"kind": "rl", "algorithm": "grpo", "updates": 1, "episodes_per_batch": 4,
                     "grpo": {"group_size": 2, "update_epochs": 2, "minibatch_size": 100}}).result(timeout=600)
    assert (ppo["updates"], grpo["updates"]) == (2, 1)
    train = [h for j in nx.tenant_log("pi-rl")["jobs"] for h in j.get("history", []) if h.get("kind") == "train"]
    assert len(train) == 3
    for h in train:  # the losses of both algorithms were computed on real log-probabilities
        assert all(math.isfinite(h[k]) for k in ("pg_loss", "approx_kl", "entropy")), h
    assert "v_loss" in train[0] and "group_return_std" in train[-1]

    live = t.predict_action(obs).result(60)
    assert live["version"] == 3
    assert np.abs(live["action"] - v0).max() > 1e-6  # the updates moved the deterministic action

    info = t.export(path=tmp_path / "pi-rl")
    policy = exported.load(info["local_path"])
    first = policy.predict_action({"state": obs.state, "instruction": obs.instruction})
    second = policy.predict_action({"state": obs.state, "instruction": obs.instruction})
    assert first["version"] == 3
    np.testing.assert_array_equal(first["action"], second["action"])  # noise off: the same action twice
    np.testing.assert_allclose(first["action"], live["action"], atol=1e-5)  # ... and the service's deterministic one


if __name__ == "__main__":  # calibration: python tests/test_rl_learning.py 2 3 4
    import json
    import sys
    import tempfile

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with Nexus.local(tempfile.mkdtemp(prefix="nexus-learning-"), n_sim=2) as service:
        for s in map(int, sys.argv[1:]):
            o = learn(service, f"cal-{s}", s)
            print(json.dumps({"seed": s, "before": o["before"]["mean_return"], "after": o["after"]["mean_return"],
                              "success": [o["before"]["success_rate"], o["after"]["success_rate"]],
                              "rollouts": o["rollout_returns"]}), flush=True)


@pytest.mark.cluster
def test_two_tenants_train_on_their_own_rewards_and_log_them_per_term(nx):
    """Over the gateway's HTTP: a bad term is a 422 naming it and creates nothing; a dense-reward and a
    sparse-reward tenant on one env run RL side by side; each rollout's per-term rewards are in the job's
    history and result and in MLflow, and add up to the rollout's return."""
    from mlflow.tracking import MlflowClient

    from tests.test_reward_terms import DENSE, PUSH, SPARSE, dense_terms

    url, auth = nx.service.gateway_url, {"Authorization": f"Bearer {nx.service.operator_token}"}
    r = httpx.post(url + "/v1/tenants", json={"name": "bad", "env": PUSH, "reward": DENSE}, headers=auth,
                   timeout=60)
    assert r.status_code == 422 and r.json()["error"]["class"] == "SpecError", r.text
    assert "'obj_to_goal_dist_below'" in r.json()["error"]["message"]
    assert httpx.get(url + "/v1/tenants/bad", headers=auth, timeout=60).status_code == 404
    assert "bad" not in {t["tenant"] for t in nx.status()["tenants"]}

    specs = {"dense": dense_terms(), "sparse": SPARSE}
    jobs = {}
    for name, terms in specs.items():
        t = nx.create_tenant({"name": f"reward-{name}", "env": PUSH, "hidden_dim": 32, "seed": 1, "reward": terms})
        jobs[name] = t.submit({"kind": "rl", "updates": 2, "episodes_per_batch": 2, "collectors": 1,
                               "ppo": {"update_epochs": 1}})
    results = {name: job.result(timeout=900) for name, job in jobs.items()}
    nx.flush()
    st = nx.status()
    client = MlflowClient(tracking_uri=f"sqlite:///{st['config']['root']}/mlflow.db")
    experiments = [e.experiment_id for e in client.search_experiments()]
    for name, terms in specs.items():
        res, keys = results[name], [f"reward/{t['term']}" for t in terms]
        assert res["updates"] == 2 and set(keys) <= set(res)
        rows = [h for j in nx.tenant_log(f"reward-{name}")["jobs"] if j["kind"] == "rl" for h in j["history"]
                if h["kind"] == "rollout"]
        assert len(rows) == 2
        for h in rows:
            assert sum(h[k] for k in keys) == pytest.approx(h["return"], rel=1e-4, abs=1e-4)
        if name == "sparse":  # episodes end at success: the success term's sum is the success flag
            assert all(h["reward/success"] == pytest.approx(h["success_rate"]) for h in rows)
        (run,) = client.search_runs(experiments, filter_string=f"tags.`nexus.job` = '{jobs[name].id}'")
        for k in keys:
            logged = [m.value for m in client.get_metric_history(run.info.run_id, f"rollout/{k}")]
            assert logged == pytest.approx([h[k] for h in rows], rel=1e-5), k
