"""Environment Service: simulators that turn a tenant's policy into trajectories.

A :class:`SimEnv` wraps one simulator instance (one episode at a time) and speaks the service's raw,
model-agnostic types (:class:`~nexus.features.Observation`); back-ends live beside it (``nexus.sim.maniskill``,
``nexus.sim.robosuite``, ``nexus.sim.libero``). :func:`make_env` builds the env a catalog entry declares — one
instance, a gymnasium vector env of ``num_envs`` CPU sub-envs, or a batched GPU simulation.
:func:`collect_episodes` runs whole episodes with a policy callable on any of them and returns trajectory
*columns* in the layout of :mod:`nexus.data.trajectory_store`, so a rollout task can append them without
reshaping.

Simulator packages (ManiSkill, sapien, robosuite, torch) are imported lazily inside functions:
importing this module stays cheap, so control-plane processes may reference it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from nexus.config.catalog import CatalogError, EnvEntry
from nexus.data.trajectory_store import episode_stats
from nexus.features import Observation, TenantSchema
from nexus.sim.base import EnvSchemaError, PolicyOutput, SimEnv, StepResult
from nexus.sim.maniskill import PROPRIO_GROUPS, ManiSkillBatchedEnv, ManiSkillEnv, cuda_available
from nexus.sim.reward import REWARD_PREFIX, TenantReward
from nexus.sim.robosuite import RobosuiteEnv
from nexus.sim.vector import LockstepEnvs, VectorSimEnv, make_single

__all__ = [
    "PROPRIO_GROUPS",
    "BatchedEnv",
    "CatalogError",
    "EnvSchemaError",
    "LockstepEnvs",
    "ManiSkillBatchedEnv",
    "ManiSkillEnv",
    "PolicyOutput",
    "RobosuiteEnv",
    "SimEnv",
    "StepResult",
    "VectorSimEnv",
    "ActionClient",
    "ActionReply",
    "PolicyClient",
    "ProducerStats",
    "collect_episodes",
    "collect_waves",
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

    def want_terms(self, names: Any) -> None:
        self.env.want_terms(names)


Policy = Callable[[Observation], PolicyOutput]
_TERMS = "terms"  # a record's per-step reward-term contributions (a tenant's own reward)
_STEP_KEYS = ("episode", "step", "state", "action", "reward", "terminated", "truncated", "success",
              "logprob", "value", "policy_version")


@dataclass
class ActionReply:
    """The answer to one request for the actions of several envs (one row per observation).

    ``features`` [n, H] are the pooled backbone features the actions were computed from (when asked
    for), ``feature_key`` names the backbone that computed them; ``engine_wait_s`` / ``compute_s`` is
    the time the request waited for its group and the group's compute time (0 in-process)."""

    outputs: list[PolicyOutput]
    features: np.ndarray | None = None
    feature_key: str | None = None
    engine_wait_s: float = 0.0
    compute_s: float = 0.0


class PendingReply(Protocol):
    def result(self) -> ActionReply: ...


class ActionClient(Protocol):
    """Where a producer gets actions: ``submit`` returns at once, ``result()`` blocks for the answer."""

    def submit(self, observations: list[Observation]) -> PendingReply: ...


@dataclass
class ProducerStats:
    """What a producer's time went to: stepping (and resetting and recording) its simulators, and
    blocking for actions; and the action round trip, split into the engine's batching wait and group
    compute and the rest (messaging = round trip - wait - compute), over the ``timed`` requests: those
    the producer still had to wait for (a reply that arrived while another wave was stepping has an
    unknown arrival time, so it is counted in ``requests`` only)."""

    sim_s: float = 0.0
    action_wait_s: float = 0.0
    requests: int = 0
    rows: int = 0
    timed: int = 0
    rtt_s: float = 0.0
    engine_wait_s: float = 0.0
    compute_s: float = 0.0
    feature_key: str | None = None  # the backbone that computed the ``feature`` column, if one was kept

    @property
    def messaging_s(self) -> float:
        return max(0.0, self.rtt_s - self.engine_wait_s - self.compute_s)

    def to_dict(self) -> dict[str, float]:
        d = asdict(self)
        d.pop("feature_key")
        return {**d, "messaging_s": self.messaging_s}


class _Done:
    def __init__(self, reply: ActionReply) -> None:
        self._reply = reply

    def result(self) -> ActionReply:
        return self._reply


class PolicyClient:
    """An in-process policy as an :class:`ActionClient`: computes at ``submit``. A policy with a
    ``batch(list[Observation]) -> list[PolicyOutput]`` method is asked once for several envs."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._batch = getattr(policy, "batch", None)

    def submit(self, observations: list[Observation]) -> PendingReply:
        if self._batch is not None and len(observations) > 1:
            outs = list(self._batch(observations))
        else:
            outs = [self.policy(o) for o in observations]
        return _Done(ActionReply(outputs=outs))


def step_slots(env: Any, slots: list[int], actions: np.ndarray) -> list[StepResult]:
    """Step the given slots of a batched env with ``actions`` [len(slots), A]; envs that can only
    step all their slots together get zeros for the others (their results are dropped)."""
    if hasattr(env, "step_slots"):
        return env.step_slots(slots, actions)
    full = np.zeros((env.num_envs, actions.shape[1]), np.float32)
    full[slots] = actions
    results = env.step(full)
    return [results[s] for s in slots]


def collect_episodes(env: SimEnv | BatchedEnv, policy: Policy, episodes: int, seed: int, tenant: str,
                     episode_offset: int = 0, reward: TenantReward | None = None) -> dict[str, np.ndarray]:
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

    ``reward``: the tenant's own reward terms: the reward column is their weighted sum (not the env's reward),
    and ``ep_reward/<term>`` holds each term's sum per episode.

    The observation after an episode's last step is not recorded: a learner that bootstraps
    truncated episodes must treat their last value as the bootstrap estimate.
    """
    columns, _ = collect_waves([env], PolicyClient(policy), episodes, seed, tenant, episode_offset, reward=reward)
    return columns


def collect_waves(waves: list[SimEnv | BatchedEnv], client: ActionClient, episodes: int, seed: int,
                  tenant: str, episode_offset: int = 0,
                  keep_features: bool = False, group_size: int = 1,
                  reward: TenantReward | None = None) -> tuple[dict[str, np.ndarray], ProducerStats]:
    """:func:`collect_episodes` over several groups ("waves") of envs, each asking ``client`` for
    the actions of all its running envs in one request.

    The waves take turns: while one wave's request is out, the next wave steps its envs with the
    actions it just got (the simulators overlap with the wait for actions); with one wave this is
    plain lockstep. Episodes go to free slots of any wave in id order, so the episodes, their seeds
    and the column layout do not depend on how the envs are split. ``keep_features``: when every
    reply carries features of one backbone, they become a ``feature`` column [N, H] (float32) and
    ``stats.feature_key`` names that backbone. ``group_size`` > 1 (GRPO): episode id ``e`` is reset with seed
    ``seed + e // group_size``, so each group of ``group_size`` consecutive episodes starts from one state.
    ``reward``: the tenant's reward terms replace the env's reward (:func:`collect_episodes`).
    """
    if episodes < 0:
        raise ValueError("episodes must be >= 0")
    if not waves:
        raise ValueError("a producer needs at least one env")
    first = waves[0]
    schema = first.schema
    low, high = first.action_bounds
    groups: list[Any] = [w if hasattr(w, "reset_some") else _One(w) for w in waves]  # type: ignore[arg-type]
    for g in groups:  # the declared reward terms this tenant's reward reads, and no others (they cost queries)
        g.want_terms(reward.names if reward is not None else ())
    cams = [c.name for c in schema.cameras]
    limit = first.max_episode_steps
    pending = list(range(episodes))[::-1]  # pop() gives the lowest pending episode
    records: dict[int, dict[str, list[Any]]] = {}
    slot_ep: dict[tuple[int, int], int] = {}  # (wave, slot) -> episode index i
    obs: dict[tuple[int, int], Observation] = {}
    stats = ProducerStats()
    features: dict[int, list[np.ndarray]] = {}
    feature_key: list[str | None] = []

    def start(w: int, slots: list[int]) -> None:
        seeds = {}
        for s in slots:
            if pending:
                i = pending.pop()
                slot_ep[(w, s)], seeds[s] = i, seed + (episode_offset + i) // group_size
                records[i] = {k: [] for k in (*_STEP_KEYS, *(f"image.{c}" for c in cams), _TERMS)}
                features[i] = []
        if seeds:
            for s, o in groups[w].reset_some(seeds).items():
                obs[(w, s)] = o

    inflight: dict[int, tuple[PendingReply, list[int], float]] = {}

    def submit(w: int) -> None:
        running = sorted(s for (ww, s) in slot_ep if ww == w)
        if running:
            inflight[w] = (client.submit([obs[(w, s)] for s in running]), running, time.perf_counter())

    t0 = time.perf_counter()
    for w in range(len(groups)):
        start(w, list(range(groups[w].num_envs)))
    stats.sim_s += time.perf_counter() - t0
    for w in range(len(groups)):
        submit(w)
    while inflight:
        for w in range(len(groups)):
            if w not in inflight:
                continue
            handle, running, t_submit = inflight.pop(w)
            ready = hasattr(handle, "done") and handle.done()
            t_wait = time.perf_counter()
            reply = handle.result()
            t_sim = time.perf_counter()
            stats.action_wait_s += t_sim - t_wait
            stats.requests += 1
            stats.rows += len(running)
            if not ready:  # it arrived just now: a true round trip
                stats.timed += 1
                stats.rtt_s += t_sim - t_submit
                stats.engine_wait_s += reply.engine_wait_s
                stats.compute_s += reply.compute_s
            outs = reply.outputs
            if len(outs) != len(running):
                raise RuntimeError(f"{len(outs)} actions for {len(running)} observations")
            if keep_features:
                feature_key.append(reply.feature_key if reply.features is not None else None)
            raws = [np.asarray(o.action, np.float32).reshape(-1) for o in outs]
            results = step_slots(groups[w], running, np.clip(np.stack(raws), low, high))
            done_slots = []
            for j, (s, out, res) in enumerate(zip(running, outs, results, strict=True)):
                i = slot_ep[(w, s)]
                rec = records[i]
                t = len(rec["step"])
                last = t == limit - 1  # the catalog's step limit is authoritative
                r = res.reward
                if reward is not None:
                    parts = reward.contributions(res.terms)
                    rec[_TERMS].append(parts)
                    r = float(np.sum(parts, dtype=np.float64))
                for key, value in (("episode", episode_offset + i), ("step", t), ("state", obs[(w, s)].state),
                                   ("action", raws[j]), ("reward", r), ("terminated", res.terminated),
                                   ("truncated", res.truncated or (last and not res.terminated)),
                                   ("success", res.success), ("logprob", out.logprob), ("value", out.value),
                                   ("policy_version", out.version)):
                    rec[key].append(value)  # the action is the policy's own sample: PPO's logprob belongs to it
                for c in cams:
                    rec[f"image.{c}"].append(obs[(w, s)].images[c])
                if keep_features and reply.features is not None:
                    features[i].append(np.asarray(reply.features[j], np.float32))
                obs[(w, s)] = res.obs
                if res.terminated or res.truncated or last:
                    done_slots.append(s)
                    del slot_ep[(w, s)]
            start(w, done_slots)
            stats.sim_s += time.perf_counter() - t_sim
            submit(w)
    cols = _columns([records[i] for i in range(episodes)], schema, tenant, episode_offset)
    if reward is not None:  # each term's share of every episode's return
        for k, name in enumerate(reward.names):
            cols[f"ep_{REWARD_PREFIX}{name}"] = np.asarray(
                [float(np.sum([p[k] for p in records[i][_TERMS]], dtype=np.float64)) for i in range(episodes)],
                np.float32)
    keys = set(feature_key)
    if keep_features and episodes and len(keys) == 1 and None not in keys:
        cols["feature"] = np.stack([f for i in range(episodes) for f in features[i]]).astype(np.float32, copy=False)
        stats.feature_key = keys.pop()
    return cols, stats


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


def term_stats(columns: dict[str, np.ndarray]) -> dict[str, float]:
    """``reward/<term>``: each reward term's mean sum per episode (they add up to the mean return)."""
    prefix = f"ep_{REWARD_PREFIX}"
    return {k.removeprefix("ep_"): float(np.mean(v, dtype=np.float64)) for k, v in columns.items()
            if k.startswith(prefix) and len(v)}


def _stack(items: list[np.ndarray], shape: tuple[int, ...], dtype: type) -> np.ndarray:
    return np.stack(items).astype(dtype, copy=False) if items else np.zeros(shape, dtype)
