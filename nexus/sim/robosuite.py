"""robosuite back-end (MuJoCo): Panda tabletop tasks, LIBERO's own engine and observation schema.

robosuite tasks (Lift, Stack, Door, ...) with LIBERO's camera pair (``agentview`` +
``robot0_eye_in_hand``) and 8-dim proprio state (eef position, eef axis-angle, gripper joints): the
small, fast tasks beside LIBERO's own scenes (:mod:`nexus.sim.libero`). robosuite 1.4.0 (the
version LIBERO pins) runs here in the same numpy-2 environment (and process) as ManiSkill, with
``mujoco==3.3.7``; its controllers are 1.4's single-arm ones (``load_controller_config``).

Set-up facts this module encodes: offscreen rendering through EGL (``MUJOCO_GL=egl``, Mesa's
software GL on CPU) chosen before MuJoCo is imported; OpenGL images come bottom-up and are flipped;
numba's JIT cache is kept in a persistent folder, and a warm-up step at creation absorbs the first
frame after a cold compile (it can be noise); episodes are seeded by reseeding robosuite's own
generator: robosuite 1.4 draws placements and initial joint noise from numpy's global generator,
which is seeded for the reset and restored afterwards (nothing else in the process sees a change).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from nexus.config.catalog import CatalogError, EnvEntry
from nexus.features import Observation
from nexus.sim.base import EnvSchemaError, SimEnv, StepResult, check_observation
from nexus.sim.reward import builtin_terms, robosuite_terms

# catalog control_mode -> robosuite 1.4 controller (IK_POSE is left out: it needs pybullet)
CONTROLLERS = {"osc_pose": "OSC_POSE", "osc_position": "OSC_POSITION", "joint_position": "JOINT_POSITION"}
AXISANGLE = "_axisangle"  # derived proprio key: "<prefix>_axisangle" from "<prefix>_quat" (xyzw)


def _prepare_process() -> None:
    """Process-wide settings that must precede the first MuJoCo / numba import."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nexus" / "numba"
    os.environ.setdefault("NUMBA_CACHE_DIR", str(cache))


def _controller(entry: EnvEntry) -> dict[str, Any]:
    from robosuite.controllers import load_controller_config

    if entry.control_mode not in CONTROLLERS:
        raise CatalogError(f"env {entry.name!r}: control_mode {entry.control_mode!r} is not one of "
                           f"{sorted(CONTROLLERS)}")
    return load_controller_config(default_controller=CONTROLLERS[entry.control_mode])


def seeded(seed: int | None, fn, *args: Any) -> Any:
    """``fn(*args)`` with numpy's global generator seeded (robosuite 1.4 draws from it), then restored."""
    if seed is None:
        return fn(*args)
    saved = np.random.get_state()
    np.random.seed(seed % 2**32)
    try:
        return fn(*args)
    finally:
        np.random.set_state(saved)


def quat_to_axisangle(q: np.ndarray) -> np.ndarray:
    """xyzw quaternion -> axis * angle (robosuite's convention, as in LIBERO's state)."""
    q = np.asarray(q, np.float64)
    w = np.clip(q[3], -1.0, 1.0)
    den = np.sqrt(1.0 - w * w)
    if den < 1e-8:
        return np.zeros(3, np.float32)
    return (q[:3] * 2.0 * np.arccos(w) / den).astype(np.float32)


def clear_gripper_actions(env: Any) -> None:
    """Zero the grippers' integrated actions: robosuite 1.4 keeps them across a soft reset (``hard_reset=False``),
    so an episode would otherwise start with the last one's gripper command."""
    for robot in env.robots:
        grippers = robot.gripper.values() if isinstance(robot.gripper, dict) else [robot.gripper]
        for g in grippers:
            if hasattr(g, "current_action"):
                g.current_action = np.zeros_like(g.current_action)


class RobosuiteEnv(SimEnv):
    """One robosuite task instance; episodes are capped by the catalog, never by robosuite."""

    def __init__(self, entry: EnvEntry) -> None:
        super().__init__(entry)
        if entry.proprio_keys is None:
            raise CatalogError(f"env {entry.name!r}: robosuite tasks must list their proprio_keys")
        _prepare_process()
        import robosuite

        options = dict(entry.options)
        robot = options.pop("robots", "Panda")
        # a fixed model seed: object sizes are drawn once, at construction, so every instance (and every
        # sub-env of a vector env) has the same objects; episodes are seeded in reset()
        model_seed = int(options.pop("seed", 0))
        cams = entry.schema.cameras
        try:
            self._env = seeded(model_seed, lambda: robosuite.make(
                entry.env_id, robots=robot, controller_configs=_controller(entry),
                has_renderer=False, has_offscreen_renderer=bool(cams), use_camera_obs=bool(cams),
                camera_names=[c.name for c in cams] or "agentview",
                camera_heights=[c.height for c in cams] or 64, camera_widths=[c.width for c in cams] or 64,
                reward_shaping=entry.reward_mode == "dense", control_freq=options.pop("control_freq", 20),
                horizon=entry.max_episode_steps, ignore_done=True, hard_reset=False, **options))
        except Exception as e:  # robosuite raises bare Exception / AssertionError for unknown names
            raise CatalogError(f"env {entry.name!r}: robosuite cannot make {entry.env_id!r}: {e}") from e
        low, high = self._env.action_spec
        if low.shape != (entry.schema.action_dim,):
            self._env.close()
            raise EnvSchemaError(f"env {entry.name!r}: simulator action shape {low.shape} != catalog "
                                 f"action_dim {entry.schema.action_dim}")
        self._low, self._high = np.asarray(low, np.float32), np.asarray(high, np.float32)
        self._t = 0
        # warm-up: compile the controller's numba kernels and drop the first rendered frame
        self._env.reset()
        self._env.step(np.zeros_like(self._low))
        self._checked = False

    @property
    def unwrapped(self) -> Any:
        """The robosuite environment (privileged simulator state, e.g. for scripted experts)."""
        return self._env

    @property
    def action_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return self._low, self._high

    def reset(self, seed: int | None = None) -> Observation:
        self._t = 0
        raw = seeded(seed, self._env.reset)
        clear_gripper_actions(self._env)
        obs = self._observation(raw)
        if not self._checked:
            check_observation(self.entry, obs, self.entry.proprio_keys)
            self._checked = True
        return obs

    def step(self, action: np.ndarray) -> StepResult:
        act = np.asarray(action, np.float32).reshape(-1)
        if act.shape != self._low.shape:
            raise ValueError(f"env {self.entry.name!r}: action shape {act.shape} != ({self._low.shape[0]},)")
        raw, reward, _done, info = self._env.step(act)
        self._t += 1
        success = bool(self._env._check_success())
        terms = builtin_terms(reward, success) | robosuite_terms(self.entry, self._env, raw, info, self.read_terms)
        return StepResult(obs=self._observation(raw), reward=float(reward),
                          terminated=success and self.entry.terminate_on_success,
                          truncated=self._t >= self.entry.max_episode_steps, success=success, terms=terms)

    def close(self) -> None:
        env, self._env = getattr(self, "_env", None), None
        if env is not None:
            env.close()

    def _observation(self, raw: dict[str, Any]) -> Observation:
        parts = []
        for key in self.entry.proprio_keys or ():
            if key.endswith(AXISANGLE) and key not in raw:
                parts.append(quat_to_axisangle(raw[key.removesuffix(AXISANGLE) + "_quat"]))
            elif key in raw:
                parts.append(np.asarray(raw[key], np.float32).reshape(-1))
            else:
                raise EnvSchemaError(f"env {self.entry.name!r}: robosuite has no observation {key!r}; it has "
                                     f"{sorted(k for k in raw if not k.endswith('_image'))}")
        images = {c.name: np.ascontiguousarray(raw[f"{c.name}_image"][::-1]) for c in self.entry.schema.cameras}
        return Observation(state=np.concatenate(parts).astype(np.float32, copy=False), images=images,
                           instruction=self.entry.schema.instruction)
