"""Environment Service: simulators that turn a tenant's policy into trajectories.

A :class:`SimEnv` wraps one simulator instance (one episode at a time) and speaks the service's
raw, model-agnostic types (:class:`~nexus.features.Observation`); back-ends live in
``nexus.simulators`` (ManiSkill3, robosuite). :func:`make_env` builds the env a catalog entry
declares — one instance, a gymnasium vector env of ``num_envs`` CPU sub-envs, or a batched GPU
simulation. :func:`collect_episodes` runs whole episodes with a policy callable on any of them and
returns trajectory *columns* in the layout of :mod:`nexus.data.trajectory_store`, so a rollout task can
append them without reshaping.

Simulator packages (ManiSkill, sapien, robosuite, torch) are imported lazily inside functions:
importing this module stays cheap, so control-plane processes may reference it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from nexus.catalog import CatalogError, EnvEntry
from nexus.features import Observation, TenantSchema
from nexus.simulators.base import EnvSchemaError, PolicyOutput, SimEnv, StepResult
from nexus.simulators.maniskill import PROPRIO_GROUPS, ManiSkillBatchedEnv, ManiSkillEnv
from nexus.simulators.robosuite import RobosuiteEnv
from nexus.simulators.vector import VectorSimEnv, make_single

__all__ = [
    "PROPRIO_GROUPS",
    "BatchedEnv",
    "CatalogError",
    "EnvSchemaError",
    "ManiSkillBatchedEnv",
    "ManiSkillEnv",
    "PolicyOutput",
    "RobosuiteEnv",
    "SimEnv",
    "StepResult",
    "VectorSimEnv",
    "collect_episodes",
    "episode_stats",
    "make_env",
    "resolve_device",
]


class BatchedEnv(Protocol):
    """Several sub-environments stepped together (CPU vector env or GPU batched simulation)."""

    num_envs: int
    entry: EnvEntry

    @property
    def schema(self) -> TenantSchema: ...

    @property
    def max_episode_steps(self) -> int: ...

    @property
    def action_bounds(self) -> tuple[np.ndarray, np.ndarray]: ...

    def reset_some(self, seeds: dict[int, int | None]) -> dict[int, Observation]: ...

    def step(self, actions: np.ndarray) -> list[StepResult]: ...

    def close(self) -> None: ...


def resolve_device(entry: EnvEntry, device: str) -> str:
    """``auto``: ManiSkill's GPU simulation when a CUDA torch and a GPU are present, else CPU."""
    if device != "auto":
        return device
    if entry.simulator == "maniskill":
        from nexus.simulators.maniskill import cuda_available

        return "cuda" if cuda_available() else "cpu"
    return "cpu"  # robosuite (MuJoCo) simulates on the CPU only


def make_env(entry: EnvEntry, seed: int = 0, device: str = "auto",
             num_envs: int | None = None) -> SimEnv | BatchedEnv:
    """Build the simulator(s) for a catalog entry, validated against its schema.

    ``num_envs`` (default: the entry's ``num_envs``) > 1 gives a :class:`BatchedEnv`: on CUDA
    ManiSkill's batched GPU simulation, otherwise a gymnasium vector env (``entry.vector_mode``).
    A single env is reset once with ``seed``; the first reset checks the produced schema.
    """
    n = entry.num_envs if num_envs is None else num_envs
    dev = resolve_device(entry, device)
    if n > 1:
        batched: BatchedEnv
        if dev.startswith("cuda") and entry.simulator == "maniskill":
            batched = ManiSkillBatchedEnv(entry, n)
        else:
            batched = VectorSimEnv(entry, n, mode=entry.vector_mode)
        try:
            batched.reset_some({i: seed + i for i in range(n)})
        except BaseException:
            batched.close()
            raise
        return batched
    env = make_single(entry, device=dev)
    try:
        env.reset(seed=seed)
    except BaseException:
        env.close()
        raise
    return env


class _One:
    """A single :class:`SimEnv` behind the batched interface (one slot)."""

    num_envs = 1

    def __init__(self, env: SimEnv) -> None:
        self.env = env

    def reset_some(self, seeds: dict[int, int]) -> dict[int, Observation]:
        return {0: self.env.reset(seed=seeds[0])}

    def step(self, actions: np.ndarray) -> list[StepResult]:
        return [self.env.step(actions[0])]


Policy = Callable[[Observation], PolicyOutput]
_STEP_KEYS = ("episode", "step", "state", "action", "reward", "terminated", "truncated", "success",
              "logprob", "value", "policy_version")


def collect_episodes(env: SimEnv | BatchedEnv, policy: Policy, episodes: int, seed: int, tenant: str,
                     episode_offset: int = 0) -> dict[str, np.ndarray]:
    """Run ``episodes`` whole episodes and return trajectory columns.

    Episode ``i`` is reset with seed ``seed + episode_offset + i`` and gets episode id
    ``episode_offset + i``, so disjoint offsets give reproducible, non-overlapping episodes across
    rollout tasks, whether the env is one instance or several sub-environments (each sub-env runs
    one episode at a time; a finished slot starts the next pending episode). With several slots,
    a policy that has a ``batch(list[Observation]) -> list[PolicyOutput]`` method is asked once per
    step for all running slots (one group-batched inference round trip).

    Per-step columns (length N, episodes contiguous and in id order) follow
    :func:`nexus.data.trajectory_store.trajectory_schema`: tenant, episode, step, state,
    ``image.<camera>``, action (the policy's sample, whose logprob is recorded; the env receives it
    clipped to the action bounds), reward, terminated, truncated, success, logprob, value,
    policy_version. Per-episode summaries (length E) use the ``ep_`` prefix: ep_episode, ep_return,
    ep_length, ep_success (success at any step); the trajectory store ignores them.

    The observation after an episode's last step is not recorded: a learner that bootstraps
    truncated episodes must treat their last value as the bootstrap estimate.
    """
    if episodes < 0:
        raise ValueError("episodes must be >= 0")
    schema = env.schema
    low, high = env.action_bounds
    batched: Any = env if hasattr(env, "reset_some") else _One(env)  # type: ignore[arg-type]
    batch_policy = getattr(policy, "batch", None)
    cams = [c.name for c in schema.cameras]
    limit = env.max_episode_steps
    pending = list(range(episodes))[::-1]  # pop() gives the lowest pending episode
    records: dict[int, dict[str, list[Any]]] = {}
    slot_ep: dict[int, int] = {}  # running slot -> episode index i
    obs: dict[int, Observation] = {}

    def start(slots: list[int]) -> None:
        seeds = {}
        for s in slots:
            if pending:
                i = pending.pop()
                slot_ep[s], seeds[s] = i, seed + episode_offset + i
                records[i] = {k: [] for k in (*_STEP_KEYS, *(f"image.{c}" for c in cams))}
        if seeds:
            obs.update(batched.reset_some(seeds))

    start(list(range(batched.num_envs)))
    while slot_ep:
        running = sorted(slot_ep)
        inputs = [obs[s] for s in running]
        outs = list(batch_policy(inputs)) if batch_policy and len(running) > 1 else [policy(o) for o in inputs]
        raws = {s: np.asarray(o.action, np.float32).reshape(-1) for s, o in zip(running, outs, strict=True)}
        actions = np.zeros((batched.num_envs, schema.action_dim), np.float32)
        for s, raw in raws.items():
            actions[s] = np.clip(raw, low, high)
        results = batched.step(actions)
        done_slots = []
        for s, out in zip(running, outs, strict=True):
            i, res, rec = slot_ep[s], results[s], records[slot_ep[s]]
            t = len(rec["step"])
            last = t == limit - 1  # the catalog's step limit is authoritative
            for key, value in (("episode", episode_offset + i), ("step", t), ("state", obs[s].state),
                               ("action", raws[s]), ("reward", res.reward), ("terminated", res.terminated),
                               ("truncated", res.truncated or (last and not res.terminated)),
                               ("success", res.success), ("logprob", out.logprob), ("value", out.value),
                               ("policy_version", out.version)):
                rec[key].append(value)  # the action is the policy's own sample: PPO's logprob belongs to it
            for c in cams:
                rec[f"image.{c}"].append(obs[s].images[c])
            obs[s] = res.obs
            if res.terminated or res.truncated or last:
                done_slots.append(s)
                del slot_ep[s]
        start(done_slots)
    return _columns([records[i] for i in range(episodes)], schema, tenant, episode_offset)


def _columns(records: list[dict[str, list[Any]]], schema: TenantSchema, tenant: str,
             episode_offset: int) -> dict[str, np.ndarray]:
    def cat(key: str) -> list[Any]:
        return [v for rec in records for v in rec[key]]

    n = sum(len(rec["step"]) for rec in records)
    cols: dict[str, np.ndarray] = {
        "tenant": np.full(n, tenant, dtype=object),
        "episode": np.asarray(cat("episode"), np.int64),
        "step": np.asarray(cat("step"), np.int32),
        "state": _stack(cat("state"), (n, schema.proprio_dim), np.float32),
    }
    for c in schema.cameras:
        cols[f"image.{c.name}"] = _stack(cat(f"image.{c.name}"), (n, c.height, c.width, 3), np.uint8)
    cols["action"] = _stack(cat("action"), (n, schema.action_dim), np.float32)
    for k, dt in (("reward", np.float32), ("terminated", np.bool_), ("truncated", np.bool_),
                  ("success", np.bool_), ("logprob", np.float32), ("value", np.float32),
                  ("policy_version", np.int64)):
        cols[k] = np.asarray(cat(k), dt)
    cols["ep_episode"] = np.arange(episode_offset, episode_offset + len(records), dtype=np.int64)
    cols["ep_return"] = np.asarray([float(np.sum(r["reward"], dtype=np.float64)) for r in records], np.float32)
    cols["ep_length"] = np.asarray([len(r["step"]) for r in records], np.int64)
    cols["ep_success"] = np.asarray([any(r["success"]) for r in records], np.bool_)
    return cols


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

