"""Environment Service against real ManiSkill3 on CPU (physx_cpu + software Vulkan), no mocks."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from nexus import catalog
from nexus.catalog import CatalogError
from nexus.environment_service import (
    EnvSchemaError,
    ManiSkillEnv,
    PolicyOutput,
    collect_episodes,
    episode_stats,
    make_env,
)
from nexus.features import Observation

torch.set_num_threads(1)

MANISKILL_ENVS = sorted(name for name, e in catalog.envs().items() if e.simulator == "maniskill")


@pytest.fixture(scope="module")
def envs():
    """One instance per catalog env, shared by the tests of this module (creation costs seconds)."""
    made: dict[str, ManiSkillEnv] = {}

    def get(name: str) -> ManiSkillEnv:
        if name not in made:
            made[name] = make_env(catalog.env(name), seed=0)
        return made[name]

    yield get
    for env in made.values():
        env.close()


def _random_policy(action_dim: int, version: int = 7, seed: int = 0):
    rng = np.random.default_rng(seed)

    def policy(obs: Observation) -> PolicyOutput:
        # deliberately out of range: the service must clip what it sends and records
        return PolicyOutput(action=rng.uniform(-2, 2, action_dim).astype(np.float32),
                            logprob=-1.5, value=0.25, version=version)

    return policy


def test_catalog_lists_the_maniskill_tasks():
    assert {"maniskill/pushcube-state", "maniskill/pickcube-state", "maniskill/pickcube-rgb"} <= set(
        MANISKILL_ENVS)


@pytest.mark.parametrize("name", MANISKILL_ENVS)
def test_env_produces_its_catalog_schema(envs, name):
    env = envs(name)
    schema = catalog.env(name).schema
    assert env.schema == schema
    obs = env.reset(seed=3)
    assert obs.state.dtype == np.float32 and obs.state.shape == (schema.proprio_dim,)
    assert obs.instruction == schema.instruction
    assert set(obs.images) == {c.name for c in schema.cameras}
    for cam in schema.cameras:
        img = obs.images[cam.name]
        assert img.dtype == np.uint8 and img.shape == (cam.height, cam.width, 3)
        assert img.std() > 0  # a real rendered frame, not a blank buffer
    for _ in range(3):
        res = env.step(np.array([0.5, -0.5, 0.2, 1.0], np.float32))
        assert type(res.success) is bool and type(res.terminated) is bool and type(res.truncated) is bool
        assert isinstance(res.reward, float) and np.isfinite(res.reward)
        assert res.obs.state.shape == (schema.proprio_dim,) and np.isfinite(res.obs.state).all()
        assert {k: v.shape for k, v in res.obs.images.items()} == {
            c.name: (c.height, c.width, 3) for c in schema.cameras}


def test_reset_is_seeded(envs):
    env = envs("maniskill/pickcube-state")
    a, b, c = env.reset(seed=11).state, env.reset(seed=11).state, env.reset(seed=12).state
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_rgb_state_is_the_documented_proprio_concatenation(envs):
    # agent.qpos(9) + agent.qvel(9) + extra.is_grasped(1) + extra.tcp_pose(7) + extra.goal_pos(3)
    env = envs("maniskill/pickcube-rgb")
    obs = env.reset(seed=5)
    base = env.unwrapped
    qpos = base.agent.robot.get_qpos()[0].numpy()
    tcp = base.agent.tcp_pose.raw_pose[0].numpy()
    goal = base.goal_site.pose.p[0].numpy()
    np.testing.assert_allclose(obs.state[:9], qpos, atol=1e-6)
    assert obs.state[18] == 0.0  # not grasped at reset
    np.testing.assert_allclose(obs.state[19:26], tcp, atol=1e-6)
    np.testing.assert_allclose(obs.state[26:29], goal, atol=1e-6)


def test_wrong_action_shape_is_rejected(envs):
    env = envs("maniskill/pushcube-state")
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action shape"):
        env.step(np.zeros(7, np.float32))


def test_collect_episodes_columns_are_consistent(envs):
    env = envs("maniskill/pickcube-state")
    cols = collect_episodes(env, _random_policy(4), episodes=2, seed=100, tenant="acme", episode_offset=5)
    n = len(cols["episode"])
    assert n == int(cols["ep_length"].sum()) and 2 <= n <= 2 * env.max_episode_steps
    for key in ("tenant", "step", "state", "action", "reward", "terminated", "truncated", "success",
                "logprob", "value", "policy_version"):
        assert len(cols[key]) == n, key
    assert cols["state"].shape == (n, 42) and cols["state"].dtype == np.float32
    assert cols["action"].shape == (n, 4) and cols["action"].dtype == np.float32
    assert np.abs(cols["action"]).max() > 1.0  # the policy's raw sample is stored (its logprob is PPO's)
    assert (cols["tenant"] == "acme").all()
    assert set(cols["episode"]) == {5, 6} and list(cols["ep_episode"]) == [5, 6]
    assert (cols["policy_version"] == 7).all() and (cols["logprob"] == -1.5).all()
    for ep, length in zip(cols["ep_episode"], cols["ep_length"], strict=True):
        rows = cols["episode"] == ep
        assert list(cols["step"][rows]) == list(range(length))
        done = cols["terminated"][rows] | cols["truncated"][rows]
        assert done[-1] and not done[:-1].any()  # exactly the last step ends the episode
        assert np.isclose(cols["reward"][rows].sum(), cols["ep_return"][list(cols["ep_episode"]).index(ep)])
    stats = episode_stats(cols)
    assert stats["episodes"] == 2 and stats["steps"] == n
    assert stats["success_rate"] == cols["ep_success"].mean()
    assert np.isclose(stats["mean_return"], cols["ep_return"].mean())

    again = collect_episodes(env, _random_policy(4), episodes=2, seed=100, tenant="acme", episode_offset=5)
    np.testing.assert_array_equal(cols["state"], again["state"])  # episodes are reproducible


def test_collect_episodes_with_camera(envs):
    env = envs("maniskill/pickcube-rgb")
    cols = collect_episodes(env, _random_policy(4, version=2), episodes=1, seed=0, tenant="cam")
    n = len(cols["episode"])
    assert cols["image.base_camera"].shape == (n, 64, 64, 3) and cols["image.base_camera"].dtype == np.uint8
    assert cols["state"].shape == (n, 29)
    assert cols["truncated"][-1] or cols["terminated"][-1]


def test_refused_and_unknown_envs_raise_catalog_error():
    with pytest.raises(CatalogError, match="refused"):
        catalog.env("maniskill/PickSingleYCB-v1")
    with pytest.raises(CatalogError, match="unknown env"):
        catalog.env("maniskill/no-such-task")
    entry = dataclasses.replace(catalog.env("maniskill/pushcube-state"), simulator="gazebo")
    with pytest.raises(CatalogError, match="unknown simulator"):
        make_env(entry)


def test_schema_mismatch_is_reported():
    entry = catalog.env("maniskill/pushcube-state")
    wrong = dataclasses.replace(entry, schema=dataclasses.replace(entry.schema, proprio_dim=36))
    with pytest.raises(EnvSchemaError, match="35 dims.*proprio_dim=36"):
        make_env(wrong)


def test_importing_the_service_does_not_import_the_simulator():
    code = ("import sys, nexus.environment_service, nexus.trajectory_store, nexus.offline_dataset; "
            "bad = [m for m in ('mani_skill', 'sapien', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
