"""Environment Service against the real simulators on CPU (ManiSkill3: physx_cpu + software Vulkan;
robosuite: MuJoCo + EGL software GL), no mocks. One instance per catalog env, shared by this module."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nexus.config import catalog
from nexus.config.catalog import CatalogError
from nexus.features import Observation
from nexus.sim.environment import (
    EnvSchemaError,
    PolicyOutput,
    SimEnv,
    VectorSimEnv,
    collect_episodes,
    episode_stats,
    make_env,
)

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
# LIBERO's scenes take a minute to build on a loaded CPU: tests/test_libero.py covers that back-end
SINGLE_ENVS = sorted(name for name, e in catalog.envs().items() if e.num_envs == 1 and e.simulator != "libero")
VECTOR_ENVS = sorted(name for name, e in catalog.envs().items() if e.num_envs > 1)


def load_generator():
    spec = importlib.util.spec_from_file_location("generate_demos", REPO / "datasets" / "generate_demos.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def envs():
    """One instance per catalog env, shared by the tests of this module (creation costs seconds)."""
    made: dict[str, SimEnv] = {}

    def get(name: str) -> SimEnv:
        if name not in made:
            made[name] = make_env(catalog.env(name), seed=0, device="cpu")
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


@pytest.mark.parametrize("name", SINGLE_ENVS)
def test_env_makes_resets_steps_and_produces_its_catalog_schema(envs, name):
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
    low, high = env.action_bounds
    assert low.shape == high.shape == (schema.action_dim,)
    rng = np.random.default_rng(0)
    for _ in range(2 if schema.cameras else 5):  # camera envs are slow on CPU
        res = env.step(rng.uniform(low, high).astype(np.float32))
        assert type(res.success) is bool and type(res.terminated) is bool and type(res.truncated) is bool
        assert isinstance(res.reward, float) and np.isfinite(res.reward)
        assert res.obs.state.shape == (schema.proprio_dim,) and np.isfinite(res.obs.state).all()
        assert {k: v.shape for k, v in res.obs.images.items()} == {
            c.name: (c.height, c.width, 3) for c in schema.cameras}


@pytest.mark.parametrize("name", ["maniskill/pickcube-state", "robosuite/lift-state"])
def test_reset_is_seeded(envs, name):
    env = envs(name)
    a, b, c = env.reset(seed=11).state, env.reset(seed=11).state, env.reset(seed=12).state
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("name, expert", [("maniskill/pickcube-state", "PickCubeExpert"),
                                          ("maniskill/pushcube-state", "PushCubeExpert"),
                                          ("robosuite/lift-state", "RobosuiteLiftExpert")])
def test_success_flag_turns_true_for_an_expert(envs, name, expert):
    env = envs(name)
    policy = getattr(load_generator(), expert)(env)
    cols = collect_episodes(env, policy, episodes=1, seed=0, tenant="expert")
    assert cols["success"][-1] and cols["ep_success"].all()
    assert cols["terminated"][-1]  # the catalog's terminate_on_success ends the episode at success
    assert not cols["success"][:-1].any()


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
    for name in ("maniskill/pushcube-state", "robosuite/lift-state"):
        env = envs(name)
        env.reset(seed=0)
        with pytest.raises(ValueError, match="action shape"):
            env.step(np.zeros(9, np.float32))


def test_collect_episodes_columns_are_consistent(envs):
    env = envs("maniskill/pickcube-state")
    # the same episodes once before: ManiSkill's reset observation carries the previous episode's contact
    # state (is_grasped), so reproducibility holds for equal histories
    collect_episodes(env, _random_policy(4), episodes=2, seed=100, tenant="acme", episode_offset=5)
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
    # episodes are reproducible (PhysX keeps some solver warm-start state across resets: not bit-exact)
    np.testing.assert_allclose(cols["state"], again["state"], atol=1e-3)


@pytest.mark.parametrize("name", ["maniskill/pickcube-rgb", "robosuite/lift-rgb"])
def test_collect_episodes_with_cameras(envs, name):
    env = envs(name)
    schema = catalog.env(name).schema
    entry = dataclasses.replace(catalog.env(name), max_episode_steps=4)  # keep camera tests short
    short = type(env).__new__(type(env))
    short.__dict__.update(env.__dict__, entry=entry)
    cols = collect_episodes(short, _random_policy(schema.action_dim, version=2), episodes=1, seed=0, tenant="cam")
    n = len(cols["episode"])
    assert n == 4 and cols["truncated"][-1]
    for c in schema.cameras:
        assert cols[f"image.{c.name}"].shape == (n, c.height, c.width, 3)
        assert cols[f"image.{c.name}"].dtype == np.uint8
    assert cols["state"].shape == (n, schema.proprio_dim)


def _deterministic(action_dim: int):
    calls = {"batch": 0}

    class Policy:
        def __call__(self, obs: Observation) -> PolicyOutput:
            return PolicyOutput(action=np.tanh(obs.state[:action_dim] * 3).astype(np.float32), version=1)

        def batch(self, observations: list[Observation]) -> list[PolicyOutput]:
            calls["batch"] += 1
            return [self(o) for o in observations]

    return Policy(), calls


@pytest.mark.parametrize("name", VECTOR_ENVS)
def test_vector_env_gives_the_serial_episodes(envs, name):
    """An AsyncVectorEnv (forkserver processes) collects exactly the episodes one instance does."""
    entry = catalog.env(name)
    policy, calls = _deterministic(entry.schema.action_dim)
    with make_env(entry, seed=0, device="cpu") as vec:
        assert isinstance(vec, VectorSimEnv) and vec.num_envs == entry.num_envs > 1
        par = collect_episodes(vec, policy, episodes=3, seed=40, tenant="v", episode_offset=2)
    assert calls["batch"] > 0  # one batched policy call per step for the running sub-envs
    with make_env(entry, seed=0, device="cpu", num_envs=1) as one:
        ser = collect_episodes(one, policy, episodes=3, seed=40, tenant="v", episode_offset=2)
    for key in ("episode", "step", "state", "action", "reward", "terminated", "truncated", "success",
                "ep_length", "ep_success"):
        np.testing.assert_array_equal(par[key], ser[key], err_msg=key)


def test_sync_vector_env_of_robosuite():
    entry = dataclasses.replace(catalog.env("robosuite/lift-state"), num_envs=2, vector_mode="sync",
                                max_episode_steps=6)
    policy, _ = _deterministic(7)
    with make_env(entry, seed=0) as vec:
        cols = collect_episodes(vec, policy, episodes=3, seed=0, tenant="s")
    assert list(cols["ep_length"]) == [6, 6, 6] and list(np.unique(cols["episode"])) == [0, 1, 2]
    with make_env(entry, seed=0, num_envs=1) as one:
        ser = collect_episodes(one, policy, episodes=3, seed=0, tenant="s")
    np.testing.assert_allclose(cols["state"], ser["state"], atol=1e-6)


def test_refused_and_unknown_envs_raise_catalog_error():
    with pytest.raises(CatalogError, match="refused"):
        catalog.env("maniskill/PickSingleYCB-v1")
    with pytest.raises(CatalogError, match="unknown env"):
        catalog.env("maniskill/no-such-task")
    entry = dataclasses.replace(catalog.env("maniskill/pushcube-state"), simulator="gazebo")
    with pytest.raises(CatalogError, match="unknown simulator"):
        make_env(entry)


def test_a_task_whose_assets_are_missing_is_refused_at_run_time_without_a_prompt():
    """Even a task that slipped past the catalog never prompts or downloads: it is refused."""
    entry = dataclasses.replace(catalog.env("maniskill/pickcube-state"), env_id="PickSingleYCB-v1")
    code = ("import dataclasses, sys\nfrom nexus.config import catalog\nfrom nexus.sim.environment import make_env\n"
            "e = dataclasses.replace(catalog.env('maniskill/pickcube-state'), env_id='PickSingleYCB-v1')\n"
            "try:\n    make_env(e, device='cpu')\nexcept catalog.CatalogError as err:\n    print('REFUSED', err)\n")
    # no stdin: a prompt would fail with EOFError instead of being answered
    out = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=300)
    assert "REFUSED" in out.stdout and "never downloads" in out.stdout, out.stdout + out.stderr
    assert entry.env_id == "PickSingleYCB-v1"


def test_unknown_robosuite_task_is_a_catalog_error():
    entry = dataclasses.replace(catalog.env("robosuite/lift-state"), env_id="NoSuchTask")
    with pytest.raises(CatalogError, match="robosuite cannot make"):
        make_env(entry)


@pytest.mark.parametrize("name, wrong, match", [
    ("maniskill/pushcube-state", 36, "35 dims.*proprio_dim=36"),
    ("robosuite/lift-state", 9, "18 dims.*proprio_dim=9"),
])
def test_schema_mismatch_is_reported(name, wrong, match):
    entry = catalog.env(name)
    bad = dataclasses.replace(entry, schema=dataclasses.replace(entry.schema, proprio_dim=wrong))
    with pytest.raises(EnvSchemaError, match=match):
        make_env(bad)


def test_importing_the_service_does_not_import_the_simulator():
    code = ("import sys, nexus.sim.environment, nexus.data.trajectory_store, nexus.data.offline_dataset, "
            "nexus.data.lerobot_format; "
            "bad = [m for m in ('mani_skill', 'sapien', 'robosuite', 'mujoco', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
