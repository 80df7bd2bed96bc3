"""ManiSkill3 back-end: ``physx_cpu`` + sapien's software-Vulkan renderer on CPU, ``physx_cuda`` on a GPU.

On CPU an instance is one env (``num_envs=1``) wrapped in ``CPUGymWrapper`` (numpy, unbatched);
parallel CPU rollouts use gymnasium vector envs over separate processes (``nexus.sim.vector``).
On a GPU, :class:`ManiSkillBatchedEnv` runs ``num_envs`` sub-scenes in one ``physx_cuda`` simulation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from nexus.config.catalog import CatalogError, EnvEntry
from nexus.features import Observation
from nexus.sim.base import (
    BatchedSimEnv,
    EnvSchemaError,
    SimEnv,
    StepResult,
    check_observation,
    leaf_keys,
    lookup,
)
from nexus.sim.reward import builtin_terms, maniskill_terms

# ManiSkill observation groups flattened, in this order, into Observation.state for camera obs
# modes (obs_mode "rgb", "rgbd", ...). Within a group the simulator's own key order is kept, which
# is fixed per task version (PickCube-v1: agent.qpos, agent.qvel, extra.is_grasped,
# extra.tcp_pose, extra.goal_pos). A catalog task may pin the exact keys with ``proprio_keys``.
PROPRIO_GROUPS: tuple[str, ...] = ("agent", "extra")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def refuse_missing_assets(env_id: str) -> None:
    """Refuse a task whose assets are not on disk, before ManiSkill would prompt for a download."""
    import mani_skill.envs  # noqa: F401  (registers the ManiSkill tasks)
    from mani_skill.utils.assets import data
    from mani_skill.utils.registration import REGISTERED_ENVS

    spec = REGISTERED_ENVS.get(env_id)
    if spec is None:
        raise CatalogError(f"ManiSkill has no task {env_id!r}")
    missing = []
    for group in spec.asset_download_ids or ():
        ids = [group] if group in data.DATA_SOURCES else data.expand_data_group_into_individual_data_source_ids(group)
        for sid in ids:
            if not data.is_data_source_downloaded(sid):
                missing.append(sid)
    if missing:
        raise CatalogError(f"ManiSkill task {env_id!r} needs assets that are not on disk ({', '.join(missing)}); "
                           "this service never downloads: place them under MS_ASSET_DIR yourself")


def _make(entry: EnvEntry, gpu: bool, num_envs: int) -> Any:
    import gymnasium as gym

    refuse_missing_assets(entry.env_id)
    kwargs: dict[str, Any] = dict(entry.options)
    if entry.schema.cameras:  # per-camera overrides, so cameras of different sizes can coexist
        kwargs["sensor_configs"] = {c.name: dict(width=c.width, height=c.height) for c in entry.schema.cameras}
    return gym.make(entry.env_id, obs_mode=entry.obs_mode, control_mode=entry.control_mode,
                    reward_mode=entry.reward_mode, max_episode_steps=entry.max_episode_steps,
                    sim_backend="physx_cuda" if gpu else "physx_cpu", render_backend="gpu" if gpu else "cpu",
                    num_envs=num_envs, **kwargs)


class _ObservationMapper:
    """Raw ManiSkill observations (one sub-env, numpy) -> :class:`Observation`."""

    def __init__(self, entry: EnvEntry) -> None:
        self.entry = entry
        self.keys: tuple[str, ...] | None = entry.proprio_keys

    def __call__(self, raw: Any) -> Observation:
        instruction = self.entry.schema.instruction
        if not isinstance(raw, Mapping):  # obs_mode "state": already the flat state vector
            return Observation(state=np.asarray(raw, np.float32).reshape(-1), instruction=instruction)
        if self.keys is None:
            self.keys = tuple(leaf_keys(raw, PROPRIO_GROUPS))
        parts = [np.asarray(lookup(raw, k), np.float32).reshape(-1) for k in self.keys]
        state = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        sensors = raw.get("sensor_data", {})
        images = {name: np.asarray(d["rgb"], np.uint8) for name, d in sensors.items() if "rgb" in d}
        return Observation(state=state, images=images, instruction=instruction)


def _check_action_space(entry: EnvEntry, shape: tuple[int, ...], env: Any) -> None:
    if tuple(shape) != (entry.schema.action_dim,):
        env.close()
        raise EnvSchemaError(f"env {entry.name!r}: simulator action shape {tuple(shape)} != catalog "
                             f"action_dim {entry.schema.action_dim}")


class ManiSkillEnv(SimEnv):
    """A ManiSkill3 task with ``num_envs=1``: CPU (``CPUGymWrapper``) or, on CUDA, the GPU backend.

    One instance is not thread-safe: use it from one thread; parallel rollouts need separate processes
    (``spawn``/``forkserver``, never ``fork``).
    """

    def __init__(self, entry: EnvEntry, device: str = "cpu") -> None:
        super().__init__(entry)
        self._gpu = device.startswith("cuda") and cuda_available()
        env = _make(entry, self._gpu, num_envs=1)
        if not self._gpu:
            from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

            env = CPUGymWrapper(env)
        self._env = env
        space = env.action_space
        shape = space.shape[-1:] if self._gpu else space.shape
        _check_action_space(entry, shape, env)
        self._low = np.asarray(space.low, np.float32).reshape(-1)[-shape[0]:]
        self._high = np.asarray(space.high, np.float32).reshape(-1)[-shape[0]:]
        self._map = _ObservationMapper(entry)
        self._checked = False

    @property
    def unwrapped(self) -> Any:
        """The ManiSkill ``BaseEnv`` (privileged simulator state, e.g. for scripted experts)."""
        return self._env.unwrapped

    @property
    def action_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return self._low, self._high

    def reset(self, seed: int | None = None) -> Observation:
        raw, _info = self._env.reset(seed=seed)
        obs = self._map(_first(raw, self._gpu))
        if not self._checked:  # the catalog is a promise to the tenant: check it once per instance
            check_observation(self.entry, obs, self._map.keys)
            self._checked = True
        return obs

    def step(self, action: np.ndarray) -> StepResult:
        act = np.asarray(action, np.float32).reshape(-1)
        if act.shape != self._low.shape:
            raise ValueError(f"env {self.entry.name!r}: action shape {act.shape} != ({self._low.shape[0]},)")
        if self._gpu:
            import torch

            act_in: Any = torch.as_tensor(act[None], device=self.unwrapped.device)
        else:
            act_in = act
        raw, reward, terminated, truncated, info = self._env.step(act_in)
        success = bool(_scalar(info.get("success", False)))
        reward = float(_scalar(reward))
        terms = builtin_terms(reward, success) | maniskill_terms(self.entry, self.unwrapped, info, self.read_terms)[0]
        return StepResult(obs=self._map(_first(raw, self._gpu)), reward=reward,
                          terminated=bool(_scalar(terminated)) and (self.entry.terminate_on_success or not success),
                          truncated=bool(_scalar(truncated)), success=success, terms=terms)

    def close(self) -> None:
        env, self._env = getattr(self, "_env", None), None
        if env is not None:
            env.close()


class ManiSkillBatchedEnv(BatchedSimEnv):
    """``num_envs`` sub-scenes of one task in one GPU (``physx_cuda``) simulation.

    Speaks the batched interface of :mod:`nexus.sim.vector` (``reset_some``, ``step``), so
    ``collect_episodes`` drives it like a CPU vector env. Partial resets use ManiSkill's ``env_idx``.
    """

    def __init__(self, entry: EnvEntry, num_envs: int) -> None:
        import torch

        self.entry, self.num_envs = entry, num_envs
        self._torch = torch
        # no auto-reset: collect_episodes resets each finished sub-scene with its next episode's seed
        self._env = _make(entry, gpu=True, num_envs=num_envs)
        space = self._env.unwrapped.single_action_space
        _check_action_space(entry, space.shape, self._env)
        self._low = np.asarray(space.low, np.float32)
        self._high = np.asarray(space.high, np.float32)
        self._maps = [_ObservationMapper(entry) for _ in range(num_envs)]
        self._seeds = [0] * num_envs
        self._checked = False

    def reset_some(self, seeds: dict[int, int | None]) -> dict[int, Observation]:
        idx = sorted(seeds)
        for i in idx:  # ManiSkill takes one seed per sub-scene (all of them) and initializes env_idx only
            self._seeds[i] = seeds[i] if seeds[i] is not None else int(np.random.randint(2**31))
        env_idx = self._torch.as_tensor(idx, device=self._env.unwrapped.device)
        raw, _ = self._env.reset(seed=list(self._seeds), options={"env_idx": env_idx})
        out = {i: self._maps[i](_index(raw, i)) for i in idx}
        if not self._checked:
            check_observation(self.entry, out[idx[0]], self._maps[idx[0]].keys)
            self._checked = True
        return out

    def step(self, actions: np.ndarray) -> list[StepResult]:
        act = self._torch.as_tensor(np.asarray(actions, np.float32), device=self._env.unwrapped.device)
        raw, reward, terminated, truncated, info = self._env.step(act)
        reward, terminated, truncated = (x.reshape(-1).cpu().numpy() for x in (reward, terminated, truncated))
        success = info.get("success")
        success = success.reshape(-1).cpu().numpy() if success is not None else np.zeros(self.num_envs, bool)
        declared = maniskill_terms(self.entry, self._env.unwrapped, info, self.read_terms)
        declared = declared * self.num_envs if len(declared) == 1 else declared  # a term without a sub-env axis
        return [StepResult(obs=self._maps[i](_index(raw, i)), reward=float(reward[i]),
                           terminated=bool(terminated[i]) and (self.entry.terminate_on_success or not success[i]),
                           truncated=bool(truncated[i]), success=bool(success[i]),
                           terms=builtin_terms(reward[i], success[i]) | declared[i]) for i in range(self.num_envs)]

    def close(self) -> None:
        env, self._env = getattr(self, "_env", None), None
        if env is not None:
            env.close()


def _index(tree: Any, i: int) -> Any:
    """Sub-env ``i`` of a batched (torch) observation tree, as numpy."""
    if isinstance(tree, Mapping):
        return {k: _index(v, i) for k, v in tree.items()}
    return tree[i].cpu().numpy() if hasattr(tree, "cpu") else tree


def _first(tree: Any, batched: bool) -> Any:
    """GPU envs return batched torch tensors; CPUGymWrapper already gives unbatched numpy."""
    return _index(tree, 0) if batched else tree


def _scalar(x: Any) -> Any:
    if hasattr(x, "cpu"):
        return x.reshape(-1)[0].item()
    return np.asarray(x).reshape(-1)[0] if np.ndim(x) else x
