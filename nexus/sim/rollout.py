"""Rollout producers: a tenant's policy in its simulator, on a ``SIM`` worker (:mod:`nexus.sim.tasks`).

A producer steps K envs of its tenant (lockstep in-process, or a vector env per wave) and asks the
engine serving its tenant for all the actions of a wave in one direct worker-to-worker call; finished episodes go to
the tenant's Arrow trajectory store (with the rollout's backbone features, for the update), and only
a small reference to the batch goes back. Simulator time and action-wait time are measured apart.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from nexus.config import catalog
from nexus.config.catalog import EnvEntry
from nexus.config.service import DataPathSettings
from nexus.data.output_dir import TenantOutputDir
from nexus.data.trajectory_store import TrajectoryStore, episode_stats
from nexus.features import TenantSchema
from nexus.sim.environment import ActionReply, PolicyOutput, collect_waves, term_stats
from nexus.sim.host import EnvPool
from nexus.sim.reward import TenantReward
from nexus.spec import RewardTerm
from nexus.wire.messages import RolloutResult
from nexus.wire.signals import emit


def producer_mode(entry: EnvEntry, vector_mode: str) -> str:
    """How a producer steps its envs: "async" (a gymnasium vector env of processes) when the data path
    asks for it or the catalog entry is an async vector env, else "lockstep" (single envs in turn)."""
    return "async" if vector_mode == "async" or (entry.num_envs > 1 and entry.vector_mode == "async") \
        else "lockstep"


def producer_envs(entry: EnvEntry, envs_per_producer: int, episodes: int | None = None) -> int:
    """How many envs a producer steps: the data path's K, at least the catalog entry's own vector size,
    and no more than the episodes it collects."""
    k = max(envs_per_producer, entry.num_envs)
    return k if episodes is None else max(1, min(episodes, k))


def wave_sizes(envs: int, waves: int) -> list[int]:
    """``envs`` envs split into at most ``waves`` non-empty groups, as even as possible."""
    waves = max(1, min(waves, envs))
    return [envs // waves + (i < envs % waves) for i in range(waves)]


class ProducerLink:
    """A producer's line to its tenant's inference engine (``engine``: a routed
    ``nexus.wire.engine_client.EngineClient``): one ``predict_batch`` request per wave and step."""

    def __init__(self, engine, tenant: str, version: int | None, deterministic: bool, job: str | None,
                 producer: str, features: bool, features_max_dim: int,
                 stopped: Callable[[], bool] = lambda: False) -> None:
        self.engine, self.tenant, self.version, self.deterministic = engine, tenant, version, deterministic
        self.job, self.producer, self.features, self.features_max_dim = job, producer, features, features_max_dim
        self.stopped = stopped

    def open(self) -> None:
        """Until it closes (or its lease ends), the engine's groups wait for this producer."""
        self.engine.call_for(self.tenant, "open_producer", self.producer, self.tenant).result()

    def close(self) -> None:
        self.engine.call_for(self.tenant, "close_producer", self.producer).result()

    def submit(self, observations: list, lead_s: float = 0.0):
        """``lead_s``: how long before sending it the request was made on the producer's devices' clock (see
        ``InferenceEngine.predict_batch``; 0 for a producer on real devices)."""
        if self.stopped():  # checked at every step: a cancelled job's producer ends within one step
            raise ProducerStopped(f"producer {self.producer}: job {self.job} was cancelled")
        extra = {"lead_s": lead_s} if lead_s > 0 else {}
        return _EngineReply(self.engine.predict_batch(self.tenant, observations, self.version, self.deterministic,
                                                      self.job, self.producer, self.features,
                                                      self.features_max_dim, **extra))


class ProducerStopped(RuntimeError):
    """The producer's job was cancelled (``SimHost.stop``): it stopped between two steps."""


class _EngineReply:
    def __init__(self, future) -> None:
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> ActionReply:
        d = self.future.result()
        outs = [PolicyOutput(action=o["action"], logprob=o["logprob"], value=o["value"], version=o["version"])
                for o in d["outputs"]]
        return ActionReply(outputs=outs, features=d["features"], feature_key=d["feature_key"],
                           engine_wait_s=d["wait_s"], compute_s=d["compute_s"])


def prewarm(pool: EnvPool, env_name: str, envs: int, waves: int = 1, vector_mode: str = "lockstep") -> int:
    """Build a producer's envs in a worker's pool ahead of the first rollout (env creation takes seconds,
    ~7 s for a camera env): the groups a rollout of ``envs`` envs in ``waves`` waves checks out
    (``vector_mode``: the data path's ``producer_vector_mode``); returns the env groups now idle."""
    entry = catalog.env(env_name)
    mode = producer_mode(entry, vector_mode)
    pool.checkin(entry, pool.checkout(entry, wave_sizes(producer_envs(entry, envs), waves), mode), mode)
    return pool.idle(entry.name)


def collect(pool: EnvPool, tenant: str, env_name: str, output_dir: str, schema: TenantSchema, episodes: int,
            seed: int, episode_offset: int, deterministic: bool, version: int | None, engine,
            job: str | None = None, producer: DataPathSettings | None = None,
            t_start: float | None = None, stopped: Callable[[], bool] = lambda: False,
            group_size: int = 1, reward: tuple[RewardTerm, ...] | None = None) -> RolloutResult:
    """Run ``episodes`` episodes (ids from ``episode_offset``) with envs from ``pool``; RL batches are
    stored, eval episodes (pinned ``version``) are not.

    ``producer``: the data-path settings (defaults if omitted): K envs (at most ``episodes``) in
    ``producer_waves`` waves, each wave asking the engine for all its actions in one request; RL batches
    keep the rollout's backbone features when ``cache_features``. ``t_start``: when the task began (its
    simulator slot is the tenant's from then on; default now). ``stopped``: asked before every step; True
    (its job was cancelled) ends the rollout with :class:`ProducerStopped`. ``group_size``: GRPO's groups
    of episodes reset with one seed (``environment.collect_waves``). ``reward``: the tenant's own reward terms
    (``TenantSpec.reward``; None: the env's reward); each term's mean per episode lands in the stats as
    ``reward/<term>``."""
    t_start = time.time() if t_start is None else t_start
    dp = producer or DataPathSettings()
    entry = catalog.env(env_name)
    k = producer_envs(entry, dp.envs_per_producer, episodes)
    mode = producer_mode(entry, dp.producer_vector_mode)
    rl = version is None
    pid = f"{tenant}/{job}/{uuid.uuid4().hex[:8]}"
    link = ProducerLink(engine, tenant, version, deterministic, job, pid,
                        features=rl and dp.cache_features, features_max_dim=dp.feature_cache_max_dim, stopped=stopped)
    groups = pool.checkout(entry, wave_sizes(k, dp.producer_waves), mode)
    try:
        link.open()
        try:
            columns, pstats = collect_waves(groups, link, episodes=episodes, seed=seed, tenant=tenant,
                                            episode_offset=episode_offset, keep_features=rl and dp.cache_features,
                                            group_size=group_size,
                                            reward=TenantReward(reward) if reward else None)
        finally:
            link.close()
    except BaseException:
        for g in groups:  # a simulator that failed mid-episode is not trusted again
            g.close()
        raise
    pool.checkin(entry, groups, mode)
    stats = episode_stats(columns) | term_stats(columns) | {"envs": k, "waves": len(groups), **pstats.to_dict()}
    batch = None
    if rl:
        store = TrajectoryStore(TenantOutputDir(output_dir).trajectories, tenant, schema)
        batch = store.append(columns, feature_key=pstats.feature_key)
    # the simulator slot is the tenant's for the whole task, waits for actions included; the split
    # (stepping vs waiting for actions) travels with the signal
    emit("rollout", tenant=tenant, job=job, t0=t_start, t1=time.time(), what="rl" if rl else "eval",
         steps=int(stats["steps"]), sim_s=pstats.sim_s, action_wait_s=pstats.action_wait_s)
    return RolloutResult(stats=stats, versions=sorted({int(v) for v in columns["policy_version"]}), batch=batch)
