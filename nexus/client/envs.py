"""The service's simulators as gymnasium environments, for a tenant's own algorithm (issue 22 item 1).

``ServiceEnv(tenant, "maniskill/pushcube-state")`` (or ``tenant.env(...)``) is a ``gymnasium.Env``;
``ServiceVectorEnv(tenant, env, num_envs=8)`` (or ``tenant.vector_env(...)``) has gymnasium's ``VectorEnv``
API with same-step autoreset. Each is one environment session on the service's simulator workers, opened
through the tenant gateway: resets and steps are HTTP calls that the gateway forwards to the worker (a vector
env's envs may be spread over several workers, ``limits.env_session_workers``, stepped at once).
Observations are a ``Dict`` of ``state`` (float32 [P]) and, for envs with cameras, ``images`` (a ``Dict``
camera -> uint8 [H, W, 3]):
the one observation layout of the service (``nexus.wire.inputs.check_observation``), so an observation goes as it
is to ``tenant.predict_action(obs)`` or an exported policy's ``predict_action`` (the instruction, left out,
defaults to the tenant's); actions a ``Box`` of the catalog's bounds. Close the env (or use it as a
context manager) to give the simulators back; an idle session closes itself after the service's
``env_session_idle_s``. The simulator seconds are metered to the tenant.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from nexus.client.http import json_bytes
from nexus.client.keepalive import KeepAlive, post_json
from nexus.wire.inputs import decode_array


def _arrays(d: dict[str, Any]) -> dict[str, Any]:
    """Wire arrays (nested: ``images`` is camera -> array) as writable numpy copies."""
    return {k: _arrays(v) if isinstance(v, dict) and "b64" not in v else np.array(decode_array(v))
            for k, v in d.items()}


class EnvSession:
    """One environment session of a tenant through its gateway (what both env classes drive)."""

    def __init__(self, tenant, env: str, num_envs: int = 1, seed: int = 0, autoreset: bool = False) -> None:
        transport = tenant.nexus.transport
        self.transport, self.tenant = transport, tenant.name
        self.base = f"/v1/tenants/{quote(tenant.name, safe='')}/envs"
        self.info = transport.request("POST", self.base, tenant=self.tenant,
                                      json_body={"env": env, "num_envs": num_envs, "seed": seed,
                                                 "autoreset": autoreset})
        self.id: str = self.info["session"]
        self.num_envs: int = int(self.info["num_envs"])
        self.closed = False
        self.keep = KeepAlive(transport)  # resets and steps: one kept-alive connection, not httpx (CPU per call)

    def spaces(self) -> tuple[spaces.Dict, spaces.Box]:
        """One env's observation and action spaces."""
        i = self.info
        obs: dict[str, spaces.Space] = {"state": spaces.Box(-np.inf, np.inf, (i["proprio_dim"],), np.float32)}
        if i["cameras"]:  # a state-only env has no "images" (gymnasium refuses an empty Dict space)
            obs["images"] = spaces.Dict({c["name"]: spaces.Box(0, 255, (c["height"], c["width"], 3), np.uint8)
                                         for c in i["cameras"]})
        action = spaces.Box(np.asarray(i["action_low"], np.float32), np.asarray(i["action_high"], np.float32),
                            dtype=np.float32)
        return spaces.Dict(obs), action

    def _post(self, verb: str, body: dict[str, Any]) -> dict[str, Any]:
        return post_json(self.transport, self.keep, f"{self.base}/{self.id}/{verb}", self.tenant, json_bytes(body))

    def reset(self, seed: int | list[int | None] | None = None, mask: np.ndarray | None = None) -> dict[str, Any]:
        out = self._post("reset", {"seed": seed, "mask": None if mask is None else [bool(m) for m in mask]})
        return _arrays(out["obs"])

    def step(self, actions: np.ndarray) -> dict[str, Any]:
        out = self._post("step", {"actions": np.asarray(actions, np.float32)})
        res = {k: np.array(decode_array(v)) for k, v in out.items() if k not in ("obs", "final")}
        for k in ("terminated", "truncated", "success"):
            res[k] = res[k].astype(bool)
        res["obs"] = _arrays(out["obs"])
        if "final" in out:
            res["final"] = _arrays(out["final"])
            res["final"]["mask"] = res["final"]["mask"].astype(bool)
        return res

    def close(self) -> dict[str, Any] | None:
        if self.closed:
            return None
        self.closed = True
        self.keep.close()
        return self.transport.request("DELETE", f"{self.base}/{self.id}", tenant=self.tenant)


def _row(obs: dict[str, Any], i: int) -> dict[str, Any]:
    """Env ``i``'s observation of a batched one (``images`` nested)."""
    return {k: _row(v, i) if isinstance(v, dict) else v[i] for k, v in obs.items()}


def unbatch(obs: dict[str, Any]) -> list[dict[str, Any]]:
    """A vector env's batched observation as one observation per env: each goes as it is to
    ``tenant.predict_batch`` / ``predict_action`` or into a ``forward_backward`` batch."""
    return [_row(obs, i) for i in range(len(obs["state"]))]


class ServiceEnv(gym.Env):
    """One env of a catalog env on the service's simulators, as a ``gymnasium.Env``."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, tenant, env: str, seed: int = 0) -> None:
        self.session = EnvSession(tenant, env, 1, seed, autoreset=False)
        self.observation_space, self.action_space = self.session.spaces()
        self.max_episode_steps = int(self.session.info["max_episode_steps"])
        self.instruction = str(self.session.info["instruction"])

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        return _row(self.session.reset(seed), 0), {}

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        out = self.session.step(np.asarray(action, np.float32).reshape(1, -1))
        return (_row(out["obs"], 0), float(out["reward"][0]), bool(out["terminated"][0]), bool(out["truncated"][0]),
                {"success": bool(out["success"][0])})

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> ServiceEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ServiceVectorEnv(VectorEnv):
    """``num_envs`` envs of a catalog env in one session on one simulator worker, with gymnasium's
    ``VectorEnv`` API and same-step autoreset: an env whose episode ended answers the first observation of
    its next episode; ``infos["final_obs"]`` (mask ``"_final_obs"``) holds its last one, ``infos["episode"]``
    its return ``r`` and length ``l`` (mask ``"_episode"``); ``infos["success"]`` every env's success flag."""

    metadata: dict[str, Any] = {"render_modes": [], "autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, tenant, env: str, num_envs: int = 1, seed: int = 0) -> None:
        self.session = EnvSession(tenant, env, num_envs, seed, autoreset=True)
        self.num_envs = self.session.num_envs
        self.single_observation_space, self.single_action_space = self.session.spaces()
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.max_episode_steps = int(self.session.info["max_episode_steps"])

    def reset(self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        mask = (options or {}).get("reset_mask")
        if seed is not None:
            self._np_random_seed = seed if isinstance(seed, int) else None
        return self.session.reset(seed, mask), {}

    def step(self, actions: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray,
                                                  dict[str, Any]]:
        out = self.session.step(actions)
        n = self.num_envs
        infos: dict[str, Any] = {"success": out["success"], "_success": np.ones(n, bool)}
        done = out["terminated"] | out["truncated"]
        if done.any():
            infos["episode"] = {"r": out["episode_return"], "l": out["episode_length"]}
            infos["_episode"] = done
        if "final" in out:
            final, mask = out["final"], out["final"]["mask"]
            rows = {k: v for k, v in final.items() if k != "mask"}
            infos["final_obs"] = np.array([_row(rows, i) if mask[i] else None for i in range(n)], dtype=object)
            infos["_final_obs"] = mask
        return out["obs"], out["reward"], out["terminated"], out["truncated"], infos

    def close_extras(self, **kwargs: Any) -> None:
        self.session.close()

    def __enter__(self) -> ServiceVectorEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
