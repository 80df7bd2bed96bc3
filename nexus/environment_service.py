"""Environment Service: simulators that turn a tenant's policy into trajectories.

A :class:`SimEnv` wraps one simulator instance (one episode at a time) and speaks the service's
raw, model-agnostic types (:class:`~nexus.features.Observation`). :func:`collect_episodes` runs whole
episodes with a policy callable and returns trajectory *columns* in the layout of
:mod:`nexus.trajectory_store`, so a rollout task can append them without reshaping.

Simulator packages (ManiSkill, sapien, torch) are imported lazily inside functions: importing this
module stays cheap, so control-plane processes may reference it without paying for a simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from nexus.catalog import CatalogError, EnvEntry
from nexus.features import Observation, TenantSchema

__all__ = [
    "EnvSchemaError",
    "ManiSkillEnv",
    "PolicyOutput",
    "SimEnv",
    "StepResult",
    "collect_episodes",
    "episode_stats",
    "make_env",
]

# ManiSkill observation groups flattened, in this order, into Observation.state for camera obs
# modes (obs_mode "rgb", "rgbd", ...). Within a group the simulator's own key order is kept, which
# is fixed per task version (PickCube-v1: agent.qpos, agent.qvel, extra.is_grasped,
# extra.tcp_pose, extra.goal_pos). A catalog task may pin the exact keys with
# ``options.proprio_keys = ["agent/qpos", ...]``.
PROPRIO_GROUPS: tuple[str, ...] = ("agent", "extra")

# Entry options consumed here; every other option is passed to gym.make as a keyword argument.
_SERVICE_OPTIONS = frozenset({"proprio_keys"})


class EnvSchemaError(CatalogError):
    """A simulator produced observations that do not match the catalog's tenant schema."""


@dataclass(frozen=True)
class StepResult:
    obs: Observation
    reward: float
    terminated: bool
    truncated: bool
    success: bool


@dataclass(frozen=True)
class PolicyOutput:
    """What a policy returns for one observation; logprob/value feed PPO, version the staleness check."""

    action: np.ndarray  # float32 [action_dim]
    logprob: float = 0.0
    value: float = 0.0
    version: int = 0


class SimEnv:
    """One simulator instance of a catalog env; subclasses implement one simulator each."""

    def __init__(self, entry: EnvEntry) -> None:
        self.entry = entry

    @property
    def schema(self) -> TenantSchema:
        return self.entry.schema

    @property
    def max_episode_steps(self) -> int:
        return self.entry.max_episode_steps

    def reset(self, seed: int | None = None) -> Observation:
        raise NotImplementedError

    def step(self, action: np.ndarray) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release the simulator; the instance is unusable afterwards."""

    def __enter__(self) -> SimEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_env(entry: EnvEntry, seed: int = 0, device: str = "cpu") -> SimEnv:
    """Build the simulator for a catalog entry and reset it once with ``seed``.

    ``device="cuda"`` selects ManiSkill's GPU physics/renderer when CUDA is available (falls back to
    the CPU backend otherwise); the first reset validates the produced schema against the catalog.
    """
    if entry.simulator == "maniskill":
        env: SimEnv = ManiSkillEnv(entry, device=device)
    else:
        raise CatalogError(f"env {entry.name!r}: unknown simulator {entry.simulator!r} "
                           "(supported: maniskill)")
    try:
        env.reset(seed=seed)
    except BaseException:
        env.close()
        raise
    return env


class ManiSkillEnv(SimEnv):
    """A ManiSkill3 task with ``num_envs=1``.

    On CPU (the default) the env runs on ``physx_cpu`` with sapien's software-Vulkan renderer and is
    wrapped in ``CPUGymWrapper`` (numpy, unbatched). One instance is not thread-safe: use it from one
    thread; parallel rollouts need separate processes (``spawn``/``forkserver``, never ``fork``).
    """

    def __init__(self, entry: EnvEntry, device: str = "cpu") -> None:
        super().__init__(entry)
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401  (registers the ManiSkill tasks with gymnasium)
        import torch

        self._gpu = device.startswith("cuda") and torch.cuda.is_available()
        options = dict(entry.options)
        self._proprio_keys: tuple[str, ...] | None = (
            tuple(options["proprio_keys"]) if "proprio_keys" in options else None)
        kwargs: dict[str, Any] = {k: v for k, v in options.items() if k not in _SERVICE_OPTIONS}
        if entry.schema.cameras:
            # per-camera overrides, so cameras of different sizes can coexist
            kwargs["sensor_configs"] = {c.name: dict(width=c.width, height=c.height)
                                        for c in entry.schema.cameras}
        env = gym.make(
            entry.env_id,
            obs_mode=entry.obs_mode,
            control_mode=entry.control_mode,
            reward_mode=entry.reward_mode,
            max_episode_steps=entry.max_episode_steps,
            sim_backend="physx_cuda" if self._gpu else "physx_cpu",
            render_backend="gpu" if self._gpu else "cpu",
            num_envs=1,
            **kwargs,
        )
        if not self._gpu:
            from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

            env = CPUGymWrapper(env)
        self._env = env
        space = env.action_space
        shape = space.shape[-1:] if self._gpu else space.shape
        if shape != (entry.schema.action_dim,):
            env.close()
            raise EnvSchemaError(f"env {entry.name!r}: simulator action shape {tuple(shape)} != catalog "
                                 f"action_dim {entry.schema.action_dim}")
        self._low = np.asarray(space.low, np.float32).reshape(-1)[-shape[0]:]
        self._high = np.asarray(space.high, np.float32).reshape(-1)[-shape[0]:]
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
        obs = self._observation(_to_numpy(raw, self._gpu))
        if not self._checked:  # the catalog is a promise to the tenant: check it once per instance
            self._check(obs)
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
        return StepResult(
            obs=self._observation(_to_numpy(raw, self._gpu)),
            reward=float(_scalar(reward, self._gpu)),
            terminated=bool(_scalar(terminated, self._gpu)),
            truncated=bool(_scalar(truncated, self._gpu)),
            success=bool(_scalar(info.get("success", False), self._gpu)),
        )

    def close(self) -> None:
        env, self._env = getattr(self, "_env", None), None
        if env is not None:
            env.close()

    def _observation(self, raw: Any) -> Observation:
        schema = self.entry.schema
        if not isinstance(raw, Mapping):  # obs_mode "state": already the flat state vector
            return Observation(state=np.asarray(raw, np.float32).reshape(-1), instruction=schema.instruction)
        if self._proprio_keys is None:
            self._proprio_keys = tuple(_leaf_keys(raw, PROPRIO_GROUPS))
        parts = [np.asarray(_lookup(raw, k), np.float32).reshape(-1) for k in self._proprio_keys]
        state = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        sensors = raw.get("sensor_data", {})
        images = {name: np.asarray(d["rgb"], np.uint8) for name, d in sensors.items() if "rgb" in d}
        return Observation(state=state, images=images, instruction=schema.instruction)

    def _check(self, obs: Observation) -> None:
        schema, name = self.entry.schema, self.entry.name
        if obs.state.shape != (schema.proprio_dim,):
            keys = f" (keys {', '.join(self._proprio_keys)})" if self._proprio_keys else ""
            raise EnvSchemaError(f"env {name!r}: simulator state has {obs.state.shape[0]} dims{keys}, "
                                 f"the catalog declares proprio_dim={schema.proprio_dim}")
        declared = {c.name: (c.height, c.width, 3) for c in schema.cameras}
        produced = {k: v.shape for k, v in obs.images.items()}
        if declared != produced:
            raise EnvSchemaError(f"env {name!r}: simulator cameras {produced} != catalog cameras {declared}")


def _leaf_keys(tree: Mapping[str, Any], groups: tuple[str, ...]) -> list[str]:
    """Slash-joined paths of all array leaves under ``groups``, in the simulator's key order."""

    def walk(node: Any, prefix: str) -> list[str]:
        if isinstance(node, Mapping):
            return [p for k, v in node.items() for p in walk(v, f"{prefix}/{k}")]
        return [prefix]

    return [p for g in groups if g in tree for p in walk(tree[g], g)]


def _lookup(tree: Mapping[str, Any], path: str) -> Any:
    node: Any = tree
    for part in path.split("/"):
        node = node[part]
    return node


def _to_numpy(tree: Any, batched: bool) -> Any:
    """GPU envs return batched torch tensors; CPUGymWrapper already gives unbatched numpy."""
    if not batched:
        return tree
    if isinstance(tree, Mapping):
        return {k: _to_numpy(v, batched) for k, v in tree.items()}
    return tree[0].cpu().numpy() if hasattr(tree, "cpu") else tree


def _scalar(x: Any, batched: bool) -> Any:
    if batched and hasattr(x, "cpu"):
        return x.reshape(-1)[0].item()
    return np.asarray(x).reshape(-1)[0] if np.ndim(x) else x


Policy = Callable[[Observation], PolicyOutput]


def collect_episodes(env: SimEnv, policy: Policy, episodes: int, seed: int, tenant: str,
                     episode_offset: int = 0) -> dict[str, np.ndarray]:
    """Run ``episodes`` whole episodes and return trajectory columns.

    Episode ``i`` is reset with seed ``seed + episode_offset + i`` and gets episode id
    ``episode_offset + i``, so disjoint offsets give reproducible, non-overlapping episodes across
    rollout tasks. Per-step columns (length N) follow :func:`nexus.trajectory_store.trajectory_schema`:
    tenant, episode, step, state, ``image.<camera>``, action (the policy's sample, whose logprob
    is recorded; the env receives it clipped to the action bounds), reward, terminated, truncated,
    success, logprob, value, policy_version.
    Per-episode summaries (length E) use the ``ep_`` prefix: ep_episode, ep_return, ep_length,
    ep_success (success at any step); the trajectory store ignores them.

    The observation after an episode's last step is not recorded: a learner that bootstraps
    truncated episodes must treat their last value as the bootstrap estimate.
    """
    if episodes < 0:
        raise ValueError("episodes must be >= 0")
    schema = env.schema
    low, high = _action_bounds(env)
    cams = [c.name for c in schema.cameras]
    rows: dict[str, list[Any]] = {k: [] for k in (
        "episode", "step", "state", "action", "reward", "terminated", "truncated", "success",
        "logprob", "value", "policy_version")}
    images: dict[str, list[np.ndarray]] = {c: [] for c in cams}
    ep_return, ep_length, ep_success = [], [], []
    for i in range(episodes):
        ep = episode_offset + i
        obs = env.reset(seed=seed + ep)
        total, success = 0.0, False
        for t in range(env.max_episode_steps):
            out = policy(obs)
            raw = np.asarray(out.action, np.float32).reshape(-1)
            res = env.step(np.clip(raw, low, high))
            rows["episode"].append(ep)
            rows["step"].append(t)
            rows["state"].append(obs.state)
            for c in cams:
                images[c].append(obs.images[c])
            rows["action"].append(raw)  # the policy's own sample: PPO's logprob belongs to it
            rows["reward"].append(res.reward)
            rows["terminated"].append(res.terminated)
            # the catalog's step limit is authoritative even if a simulator forgets to truncate
            last = t == env.max_episode_steps - 1
            rows["truncated"].append(res.truncated or (last and not res.terminated))
            rows["success"].append(res.success)
            rows["logprob"].append(out.logprob)
            rows["value"].append(out.value)
            rows["policy_version"].append(out.version)
            total += res.reward
            success |= res.success
            obs = res.obs
            if res.terminated or res.truncated:
                break
        ep_return.append(total)
        ep_length.append(t + 1)
        ep_success.append(success)

    n = len(rows["episode"])
    cols: dict[str, np.ndarray] = {
        "tenant": np.full(n, tenant, dtype=object),
        "episode": np.asarray(rows["episode"], np.int64),
        "step": np.asarray(rows["step"], np.int32),
        "state": _stack(rows["state"], (n, schema.proprio_dim), np.float32),
    }
    for c in schema.cameras:
        cols[f"image.{c.name}"] = _stack(images[c.name], (n, c.height, c.width, 3), np.uint8)
    cols["action"] = _stack(rows["action"], (n, schema.action_dim), np.float32)
    for k, dt in (("reward", np.float32), ("terminated", np.bool_), ("truncated", np.bool_),
                  ("success", np.bool_), ("logprob", np.float32), ("value", np.float32),
                  ("policy_version", np.int64)):
        cols[k] = np.asarray(rows[k], dt)
    cols["ep_episode"] = np.arange(episode_offset, episode_offset + episodes, dtype=np.int64)
    cols["ep_return"] = np.asarray(ep_return, np.float32)
    cols["ep_length"] = np.asarray(ep_length, np.int64)
    cols["ep_success"] = np.asarray(ep_success, np.bool_)
    return cols


def _action_bounds(env: SimEnv) -> tuple[np.ndarray, np.ndarray]:
    bounds = getattr(env, "action_bounds", None)
    if bounds is not None:
        return bounds
    a = env.schema.action_dim  # the service's action convention: normalized to [-1, 1]
    return -np.ones(a, np.float32), np.ones(a, np.float32)


def _stack(items: list[np.ndarray], shape: tuple[int, ...], dtype: type) -> np.ndarray:
    return np.stack(items).astype(dtype, copy=False) if items else np.zeros(shape, dtype)


def episode_stats(columns: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Mean return, success rate (success at any step), episodes and steps of per-step columns.

    Works on :func:`collect_episodes` output, on ``table_arrays`` of stored trajectories and on
    offline-dataset arrays alike: it only needs the episode, reward and success columns.
    """
    episode = np.asarray(columns["episode"])
    steps = int(episode.shape[0])
    if steps == 0:
        return {"episodes": 0, "steps": 0, "mean_return": float("nan"), "success_rate": float("nan"),
                "mean_length": float("nan")}
    ids, inverse, lengths = np.unique(episode, return_inverse=True, return_counts=True)
    returns = np.bincount(inverse, weights=np.asarray(columns["reward"], np.float64), minlength=len(ids))
    success = np.bincount(inverse, weights=np.asarray(columns["success"], np.float64), minlength=len(ids)) > 0
    return {
        "episodes": int(len(ids)),
        "steps": steps,
        "mean_return": float(returns.mean()),
        "success_rate": float(success.mean()),
        "mean_length": float(lengths.mean()),
    }
