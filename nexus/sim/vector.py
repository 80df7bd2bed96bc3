"""Several sub-environments per rollout task: gymnasium vector envs over catalog envs.

Each sub-environment is a :class:`GymSimEnv` — any catalog env (ManiSkill or robosuite) behind the
plain ``gymnasium.Env`` API — so one vector wrapper serves every simulator. ``async`` runs each
sub-env in its own process started with ``forkserver`` (``fork`` deadlocks once torch/sapien are
imported in the parent; ``spawn`` works too but re-imports more); ``sync`` steps them in-process.
Autoreset is disabled: ``collect_episodes`` resets exactly the slots whose episode ended, each with
the seed of the episode it starts next, so vectorized and serial collection give the same episodes.
"""

from __future__ import annotations

import functools
import multiprocessing
import warnings
from collections.abc import Collection
from typing import Any

import numpy as np

from nexus.config.catalog import EnvEntry
from nexus.features import Observation
from nexus.sim.base import BatchedSimEnv, StepResult

IMAGE_PREFIX = "image."
TERM_PREFIX = "term."  # a sub-env's reward terms in the vector env's info (flat keys: gymnasium stacks them)


def make_single(entry: EnvEntry, device: str = "cpu") -> Any:
    """One simulator instance of ``entry`` (a :class:`~nexus.sim.base.SimEnv`), not yet reset."""
    if entry.simulator == "maniskill":
        from nexus.sim.maniskill import ManiSkillEnv

        return ManiSkillEnv(entry, device=device)
    if entry.simulator == "robosuite":
        from nexus.sim.robosuite import RobosuiteEnv

        return RobosuiteEnv(entry)
    if entry.simulator == "libero":
        from nexus.sim.libero import LiberoEnv

        return LiberoEnv(entry)
    from nexus.config.catalog import SIMULATORS, CatalogError

    raise CatalogError(f"env {entry.name!r}: unknown simulator {entry.simulator!r} (supported: "
                       f"{', '.join(SIMULATORS)})")


def _gym_env_class() -> type:
    import gymnasium as gym
    from gymnasium import spaces

    class GymSimEnv(gym.Env):
        """A catalog env as a ``gymnasium.Env``: Dict observations ``state`` + ``image.<camera>``."""

        metadata: dict[str, Any] = {"render_modes": []}

        def __init__(self, entry: EnvEntry) -> None:
            import torch

            torch.set_num_threads(1)  # one simulator per process on shared cores
            self.sim = make_single(entry)
            s = entry.schema
            obs = {"state": spaces.Box(-np.inf, np.inf, (s.proprio_dim,), np.float32)}
            obs.update({f"{IMAGE_PREFIX}{c.name}": spaces.Box(0, 255, (c.height, c.width, 3), np.uint8)
                        for c in s.cameras})
            self.observation_space = spaces.Dict(obs)
            low, high = self.sim.action_bounds
            self.action_space = spaces.Box(low, high, dtype=np.float32)

        def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
            super().reset(seed=seed)
            return _to_dict(self.sim.reset(seed=seed)), {}

        def step(self, action: np.ndarray) -> tuple[dict, float, bool, bool, dict]:
            r = self.sim.step(action)
            return _to_dict(r.obs), r.reward, r.terminated, r.truncated, {
                "success": r.success, **{f"{TERM_PREFIX}{k}": v for k, v in r.terms.items()}}

        def close(self) -> None:
            self.sim.close()

        def want_terms(self, names: frozenset[str] | None) -> None:
            self.sim.want_terms(names)

    return GymSimEnv


def _to_dict(obs: Observation) -> dict[str, np.ndarray]:
    return {"state": obs.state, **{f"{IMAGE_PREFIX}{k}": v for k, v in obs.images.items()}}


def _new_gym_env(entry: EnvEntry) -> Any:
    return _gym_env_class()(entry)


def gym_env(entry: EnvEntry) -> Any:
    """One catalog env in this process as a ``gymnasium.Env`` (Dict observations ``state`` + ``image.<camera>``,
    the layout of the service's environment sessions), with the catalog's episode length as its time limit."""
    from gymnasium.wrappers import TimeLimit

    return TimeLimit(_new_gym_env(entry), max_episode_steps=entry.max_episode_steps)


class VectorSimEnv(BatchedSimEnv):
    """``num_envs`` sub-environments of one catalog env behind a gymnasium vector env (CPU)."""

    def __init__(self, entry: EnvEntry, num_envs: int, mode: str = "async", context: str = "forkserver") -> None:
        import gymnasium as gym
        from gymnasium.vector import AutoresetMode

        self.entry, self.num_envs = entry, num_envs
        if mode == "async" and multiprocessing.current_process().daemon:
            # a daemonic process (a Dask worker under its nanny, by default) may not start children:
            # step the sub-envs in-process; the policy is still asked once per step for all of them
            warnings.warn(f"env {entry.name!r}: daemonic process, running its {num_envs} sub-envs in-process "
                          "(set DASK_DISTRIBUTED__WORKER__DAEMON=False for one process per sub-env)", stacklevel=2)
            mode = "sync"
        self.mode = mode
        fns = [functools.partial(_new_gym_env, entry) for _ in range(num_envs)]
        if mode == "async":
            self._env: Any = gym.vector.AsyncVectorEnv(fns, context=context, autoreset_mode=AutoresetMode.DISABLED)
        elif mode == "sync":
            self._env = gym.vector.SyncVectorEnv(fns, autoreset_mode=AutoresetMode.DISABLED)
        else:
            raise ValueError(f"vector mode {mode!r} is not 'async' or 'sync'")
        space = self._env.single_action_space
        self._low = np.asarray(space.low, np.float32)
        self._high = np.asarray(space.high, np.float32)
        self._cams = [c.name for c in entry.schema.cameras]
        self._ended = np.zeros(num_envs, bool)  # sub-envs whose episode ended and that were not reset yet

    def reset_some(self, seeds: dict[int, int | None]) -> dict[int, Observation]:
        """Reset the slots in ``seeds`` (slot -> episode seed); the other slots keep their state."""
        mask = np.zeros(self.num_envs, np.bool_)
        mask[list(seeds)] = True
        raw, _ = self._env.reset(seed=[seeds.get(i) for i in range(self.num_envs)], options={"reset_mask": mask})
        self._ended &= ~mask
        return {i: self._observation(raw, i) for i in seeds}

    def step(self, actions: np.ndarray) -> list[StepResult]:
        if self._ended.any():  # idle slots (no episode left for them) must be reset before the next step
            self.reset_some({int(i): None for i in np.flatnonzero(self._ended)})
        raw, reward, terminated, truncated, info = self._env.step(np.asarray(actions, np.float32))
        self._ended = np.asarray(terminated, bool) | np.asarray(truncated, bool)
        success = np.asarray(info.get("success", np.zeros(self.num_envs, bool)), bool)
        terms = {k.removeprefix(TERM_PREFIX): np.asarray(v, np.float64) for k, v in info.items()
                 if k.startswith(TERM_PREFIX)}
        return [StepResult(obs=self._observation(raw, i), reward=float(reward[i]), terminated=bool(terminated[i]),
                           truncated=bool(truncated[i]), success=bool(success[i]),
                           terms={k: float(v[i]) for k, v in terms.items()}) for i in range(self.num_envs)]

    def want_terms(self, names: Collection[str] | None) -> None:
        super().want_terms(names)
        self._env.call("want_terms", self.read_terms)  # in every sub-env (its own process when async)

    def _observation(self, raw: dict[str, np.ndarray], i: int) -> Observation:
        # copies: the vector env reuses its (shared-memory) buffers on the next call
        return Observation(state=np.array(raw["state"][i], np.float32),
                           images={c: np.array(raw[f"{IMAGE_PREFIX}{c}"][i]) for c in self._cams},
                           instruction=self.entry.schema.instruction)

    def close(self) -> None:
        env, self._env = getattr(self, "_env", None), None
        if env is not None:
            env.close()

    def __enter__(self) -> VectorSimEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LockstepEnvs(BatchedSimEnv):
    """Several single envs of one catalog env in this process, stepped together (one after another).

    The cheap way to give one producer K envs on CPU: no process per env (a ManiSkill rgb env costs
    ~800 MB for the first instance of a process and ~30 MB for each further one), and only the slots
    with a running episode are stepped (:meth:`step_slots`). The envs belong to the caller (e.g. a
    worker's env pool); :meth:`close` closes them.
    """

    def __init__(self, envs: list[Any]) -> None:
        if not envs:
            raise ValueError("LockstepEnvs needs at least one env")
        entries = {e.entry.name for e in envs}
        if len(entries) != 1:
            raise ValueError(f"lockstep envs must share one catalog env, got {sorted(entries)}")
        self.envs = list(envs)
        self.entry, self.num_envs = envs[0].entry, len(envs)
        self._low, self._high = envs[0].action_bounds

    def reset_some(self, seeds: dict[int, int | None]) -> dict[int, Observation]:
        return {i: self.envs[i].reset(seed=s) for i, s in seeds.items()}

    def want_terms(self, names: Collection[str] | None) -> None:
        super().want_terms(names)
        for e in self.envs:
            e.want_terms(names)

    def step(self, actions: np.ndarray) -> list[StepResult]:
        return self.step_slots(list(range(self.num_envs)), np.asarray(actions, np.float32))

    def step_slots(self, slots: list[int], actions: np.ndarray) -> list[StepResult]:
        """Step only ``slots`` with ``actions`` [len(slots), A]."""
        return [self.envs[s].step(a) for s, a in zip(slots, np.asarray(actions, np.float32), strict=True)]

    def close(self) -> None:
        for e in self.envs:
            e.close()
