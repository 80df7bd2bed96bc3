"""A tenant's own reward in a service-hosted env (``TenantSpec.reward``): declarative terms over what the env
exposes, checked against the catalog (a bad term is a 422 naming it, nothing created), computed from the real
simulator's state, and logged per term (job history, job result, MLflow) while RL trains on them.

Whether a dense and a sparse tenant learn side by side is measured in experiments/reward_terms/run.py
(minutes of training: too long for a test); the tenants' RL through the service is in test_rl_learning.py
(it shares that module's service)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nexus.config import catalog
from nexus.config.validation import validate_tenant
from nexus.errors import SpecError
from nexus.features import Observation
from nexus.sim.base import PolicyOutput
from nexus.sim.environment import collect_episodes, make_env
from nexus.sim.reward import TenantReward
from nexus.spec import RewardTerm

PUSH = "maniskill/pushcube-state"
DENSE = [{"term": "success", "weight": 2.0},
         {"term": "tcp_to_obj_dist", "weight": 0.5, "transform": "tanh", "scale": 5.0},
         {"term": "obj_to_goal_dist", "weight": 1.0, "transform": "exp", "scale": 10.0},
         {"term": "obj_to_goal_dist_below", "weight": 1.0}]  # a bad one, dropped below where it must be valid
SPARSE = [{"term": "success", "weight": 1.0}]


def dense_terms() -> list[dict]:
    return DENSE[:3]


def test_a_reward_names_only_what_its_env_exposes():
    spec, _ = validate_tenant({"name": "dense", "env": PUSH, "reward": dense_terms()})
    assert [t.term for t in spec.reward] == ["success", "tcp_to_obj_dist", "obj_to_goal_dist"]
    with pytest.raises(SpecError) as e:
        validate_tenant({"name": "bad", "env": PUSH, "reward": DENSE})
    msg = str(e.value)
    assert "'obj_to_goal_dist_below'" in msg and "not exposed by env 'maniskill/pushcube-state'" in msg
    assert "it exposes: success, env_reward, tcp_to_obj_dist, obj_to_goal_dist, finger_obj_contact" in msg
    # an info term of PickCube is not one of PushCube's; it is PickCube's
    with pytest.raises(SpecError, match="'info.is_grasped' is not exposed"):
        validate_tenant({"name": "bad", "env": PUSH, "reward": [{"term": "info.is_grasped"}]})
    validate_tenant({"name": "pick", "env": "maniskill/pickcube-state", "reward": [{"term": "info.is_grasped"}]})
    # no expression grammar: a term is a name, a transform one of four
    for bad, what in (({"term": "success * 2"}, "term"), ({"term": "success", "transform": "log"}, "transform"),
                      ({"term": "success", "transform": "below"}, "threshold"),
                      ({"term": "success", "threshold": 0.1}, "threshold")):
        with pytest.raises(SpecError, match=what):
            validate_tenant({"name": "bad", "env": PUSH, "reward": [bad]})
    with pytest.raises(SpecError, match="appear twice"):
        validate_tenant({"name": "bad", "env": PUSH, "reward": SPARSE * 2})
    with pytest.raises(SpecError, match="needs a catalog 'env'"):
        validate_tenant({"name": "bad", "external": {"proprio_dim": 3, "action_dim": 2}, "reward": SPARSE})


class Scripted:
    """Moves the end effector towards the cube, then along +x (the push direction): episodes touch the cube."""

    def __call__(self, obs: Observation) -> PolicyOutput:
        s = obs.state
        tcp, cube = s[18:21], s[28:31]  # PushCube's state: qpos 9, qvel 9, tcp pose 7, goal 3, cube pose 7
        target = cube + np.array([-0.05, 0.0, 0.0]) if tcp[0] < cube[0] - 0.03 else cube + np.array([0.1, 0, 0])
        return PolicyOutput(action=np.append(np.clip((target - tcp) * 20, -1, 1), 1.0).astype(np.float32))


def test_the_terms_come_from_the_simulator_and_their_sum_is_the_reward():
    """A real PushCube env: a distance term after a step is the distance in the next observation; the stored
    reward is the weighted, transformed sum of the terms, and each term's per-episode share adds up to it; a
    vector env's sub-envs give the same."""
    entry = dataclasses.replace(catalog.env(PUSH), max_episode_steps=20, vector_mode="sync")
    env = make_env(entry, seed=0, device="cpu")
    try:
        obs = env.reset(seed=3)
        res = env.step(Scripted()(obs).action)
        s = res.obs.state
        assert set(res.terms) == set(entry.reward_term_names)
        assert res.terms["tcp_to_obj_dist"] == pytest.approx(np.linalg.norm(s[18:21] - s[28:31]), abs=1e-5)
        assert res.terms["obj_to_goal_dist"] == pytest.approx(np.linalg.norm(s[28:30] - s[25:27]), abs=1e-5)
        assert res.terms["env_reward"] == res.reward and res.terms["success"] == float(res.success)
        reward = TenantReward([RewardTerm.model_validate(t) for t in dense_terms()])
        cols = collect_episodes(env, Scripted(), episodes=2, seed=11, tenant="dense", reward=reward)
        plain = collect_episodes(env, Scripted(), episodes=2, seed=11, tenant="dense")
    finally:
        env.close()
    vec = make_env(entry, seed=0, device="cpu", num_envs=2)  # the terms travel through the vector env's info
    try:
        vcols = collect_episodes(vec, Scripted(), episodes=2, seed=11, tenant="dense", reward=reward)
    finally:
        vec.close()
    for key in ("state", "reward", "ep_reward/tcp_to_obj_dist", "ep_return"):
        np.testing.assert_allclose(vcols[key], cols[key], rtol=1e-6, err_msg=key)
    states, steps = cols["state"], cols["step"]
    first = np.flatnonzero(steps == 0)
    # the reward after step t from the state of step t + 1 (within an episode), computed here independently
    nxt = np.array([i + 1 for i in range(len(steps) - 1) if steps[i + 1] == steps[i] + 1])
    tcp_obj = np.linalg.norm(states[nxt][:, 18:21] - states[nxt][:, 28:31], axis=1)
    obj_goal = np.linalg.norm(states[nxt][:, 28:30] - states[nxt][:, 25:27], axis=1)
    want = 2.0 * cols["success"][nxt - 1] + 0.5 * (1 - np.tanh(5 * tcp_obj)) + np.exp(-10 * obj_goal)
    np.testing.assert_allclose(cols["reward"][nxt - 1], want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(cols["reward"], plain["reward"])  # not the env's own reward
    np.testing.assert_array_equal(cols["state"], plain["state"])  # the same episodes
    parts = [cols[f"ep_reward/{t['term']}"] for t in dense_terms()]
    np.testing.assert_allclose(np.sum(parts, axis=0), cols["ep_return"], rtol=1e-5)
    assert len(first) == 2 and "ep_reward/success" not in plain


@pytest.mark.parametrize("name", ["maniskill/pickcube-state", "robosuite/lift-state"])
def test_every_declared_term_is_read_by_its_simulator(name):
    """The terms a catalog entry declares come out of its back-end after a step (pushcube: above)."""
    entry = catalog.env(name)
    env = make_env(entry, seed=0, device="cpu")
    try:
        res = env.step(np.zeros(entry.schema.action_dim, np.float32))
    finally:
        env.close()
    assert set(res.terms) == set(entry.reward_term_names) and len(res.terms) > 2
    assert all(np.isfinite(v) for v in res.terms.values())
    dist = next(k for k in res.terms if k.endswith("_dist"))
    assert 0.0 < res.terms[dist] < 1.0  # metres between the gripper and the cube at the start
