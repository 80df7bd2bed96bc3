"""Stable-Baselines3 interop (issue 22 item 5; SB3 is an optional extra: ``pip install -e '.[sb3]'``).

* :class:`SB3VecEnv` — a :class:`~nexus.client.envs.ServiceVectorEnv` as SB3's own ``VecEnv`` (SB3 takes a
  ``gymnasium.Env`` or its ``VecEnv``, not gymnasium's ``VectorEnv``): ``PPO("MultiInputPolicy",
  SB3VecEnv(tenant.vector_env("maniskill/pushcube-state", 8)))`` trains on the service's simulators.
  Episodes that end carry ``terminal_observation`` and ``TimeLimit.truncated`` in their info, as SB3's own
  vector envs do (the service resets them in the same step). SB3 takes no nested ``Dict``, so its
  observations are the service's layout flattened (:func:`nexus.wire.inputs.flat_observation`: ``state``,
  ``images.<camera>``).
* :func:`nexus.export.policy.ExportedPolicy.predict` — an exported policy acts where SB3 expects
  ``predict(obs) -> (action, state)`` (``evaluate_policy(policy, env)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import spaces
from stable_baselines3.common.vec_env import VecEnv

from nexus.client.envs import ServiceVectorEnv
from nexus.wire.inputs import flat_observation


class SB3VecEnv(VecEnv):
    """SB3's ``VecEnv`` over one environment session (its envs step together on one simulator worker)."""

    def __init__(self, venv: ServiceVectorEnv) -> None:
        self.venv = venv
        super().__init__(venv.num_envs, spaces.Dict(flat_observation(venv.single_observation_space.spaces)),
                         venv.single_action_space)
        self._actions: np.ndarray | None = None

    def reset(self) -> dict[str, np.ndarray]:
        seeds = None if all(s is None for s in self._seeds) else self._seeds
        obs, _ = self.venv.reset(seed=seeds)
        self._reset_seeds()
        self._reset_options()
        return flat_observation(obs)

    def step_async(self, actions: np.ndarray) -> None:
        self._actions = np.asarray(actions, np.float32).reshape(self.num_envs, -1)

    def step_wait(self) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, list[dict[str, Any]]]:
        assert self._actions is not None, "step_async first"
        nested, reward, terminated, truncated, infos = self.venv.step(self._actions)
        obs = flat_observation(nested)
        self._actions = None
        dones = terminated | truncated
        out: list[dict[str, Any]] = [{"success": bool(s)} for s in infos["success"]]
        final = infos.get("final_obs")
        for i in np.flatnonzero(dones):
            out[i]["terminal_observation"] = flat_observation(final[i]) if final is not None and \
                final[i] is not None else {k: v[i] for k, v in obs.items()}
            out[i]["TimeLimit.truncated"] = bool(truncated[i] and not terminated[i])
            out[i]["episode"] = {"r": float(infos["episode"]["r"][i]), "l": int(infos["episode"]["l"][i])}
        return obs, reward.astype(np.float32), dones, out

    def close(self) -> None:
        self.venv.close()

    # the envs live on the service: no attributes or methods to reach, no wrappers
    def get_attr(self, attr_name: str, indices: Any = None) -> list[Any]:
        if attr_name == "render_mode":
            return [None for _ in self._get_indices(indices)]
        value = getattr(self.venv, attr_name)
        return [value for _ in self._get_indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices: Any = None) -> None:
        raise AttributeError(f"environment-session envs have no settable attribute {attr_name!r}")

    def env_method(self, method_name: str, *method_args: Any, indices: Any = None, **method_kwargs: Any) -> list[Any]:
        raise AttributeError(f"environment-session envs have no method {method_name!r} to call")

    def env_is_wrapped(self, wrapper_class: type, indices: Any = None) -> list[bool]:
        return [False for _ in self._get_indices(indices)]

    def get_images(self) -> Sequence[np.ndarray | None]:
        return [None] * self.num_envs

    def __enter__(self) -> SB3VecEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
