"""robosuite (LIBERO's engine) in the service's numpy-2 environment: the LIBERO-like schema it produces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nexus.config import catalog
from nexus.sim.environment import make_env
from nexus.sim.robosuite import quat_to_axisangle

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lift_rgb():
    env = make_env(catalog.env("robosuite/lift-rgb"), seed=0)
    yield env
    env.close()


def test_robosuite_and_maniskill_share_numpy_2_and_one_process(lift_rgb):
    import mani_skill
    import mujoco
    import robosuite

    assert np.__version__.startswith("2.") and robosuite.__version__ == "1.4.0"
    assert mujoco.__version__ == "3.3.7" and mani_skill.__version__.startswith("3.")


def test_libero_state_is_eef_position_axis_angle_and_gripper(lift_rgb):
    import robosuite.utils.transform_utils as T

    obs = lift_rgb.reset(seed=4)
    raw = lift_rgb.unwrapped._get_observations(force_update=True)
    np.testing.assert_allclose(obs.state[:3], raw["robot0_eef_pos"], atol=1e-6)
    np.testing.assert_allclose(obs.state[3:6], T.quat2axisangle(raw["robot0_eef_quat"]), atol=1e-5)
    np.testing.assert_allclose(obs.state[6:8], raw["robot0_gripper_qpos"], atol=1e-6)
    # images are flipped to the usual top-down row order (OpenGL renders bottom-up)
    np.testing.assert_array_equal(obs.images["agentview"], raw["agentview_image"][::-1])
    np.testing.assert_array_equal(obs.images["robot0_eye_in_hand"], raw["robot0_eye_in_hand_image"][::-1])


def test_camera_frames_are_rendered_scenes_not_noise(lift_rgb):
    obs = lift_rgb.reset(seed=1)
    for name, img in obs.images.items():
        # neighbouring pixels of a rendered scene are similar; a garbage frame (cold numba cache) is noise
        roughness = np.abs(np.diff(img.astype(np.int16), axis=1)).mean()
        assert img.std() > 5 and roughness < 15, (name, roughness)
    # the table is below the robot in the agent view: the bottom rows are table-coloured, not sky
    top, bottom = obs.images["agentview"][:8].mean(), obs.images["agentview"][-8:].mean()
    assert top != bottom


def test_axis_angle_matches_robosuite():
    import robosuite.utils.transform_utils as T

    rng = np.random.default_rng(0)
    for _ in range(20):
        q = rng.normal(size=4)
        q /= np.linalg.norm(q)
        np.testing.assert_allclose(quat_to_axisangle(q), T.quat2axisangle(q.astype(np.float64)), atol=1e-5)
    assert not quat_to_axisangle(np.array([0, 0, 0, 1.0])).any()


def test_actions_move_the_end_effector(lift_rgb):
    obs = lift_rgb.reset(seed=2)
    for _ in range(3):
        res = lift_rgb.step(np.array([0, 0, 1.0, 0, 0, 0, -1], np.float32))  # up, gripper open
    assert res.obs.state[2] > obs.state[2] + 0.02  # z rose
    assert not res.success and not res.terminated
