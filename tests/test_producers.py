"""Producers that keep the engine fed, and no repeated backbone work in the update.

Real simulators (ManiSkill3 on CPU), the real inference engine (its coroutines on an asyncio loop in
a thread, as on a Dask worker), the real rollout task function, the real Arrow store and the actor's
real PPO update on DeepSpeed slots; no cluster.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from nexus.config import catalog
from nexus.config.service import ServiceConfig
from nexus.data.output_dir import TenantOutputDir
from nexus.data.trajectory_store import batch_metadata, read_ipc, table_arrays
from nexus.features import Observation
from nexus.sim import rollout
from nexus.sim.environment import (
    ActionReply,
    LockstepEnvs,
    PolicyOutput,
    collect_episodes,
    collect_waves,
    make_env,
)
from nexus.spec import PPOConfig, TenantSpec

torch.set_num_threads(1)


def _policy(obs: Observation) -> PolicyOutput:
    """Deterministic and state-dependent: any mix-up of envs changes the episodes."""
    return PolicyOutput(action=np.tanh(obs.state[:4] * 3).astype(np.float32), logprob=-1.0, value=0.5, version=3)


class SlowClient:
    """Answers on a thread after a pause, like a remote engine: the producer must not block on it
    before it has stepped its other wave."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(2)
        self.sizes: list[int] = []

    def submit(self, observations):
        self.sizes.append(len(observations))

        def answer():
            time.sleep(0.02)  # well above one env step (even on a loaded machine): the producer does wait
            return ActionReply(outputs=[_policy(o) for o in observations], engine_wait_s=0.0005, compute_s=0.001)

        return self.pool.submit(answer)


def test_waves_collect_the_serial_episodes_and_split_sim_from_wait():
    entry = dataclasses.replace(catalog.env("maniskill/pushcube-state"), max_episode_steps=15)
    envs = [make_env(entry, seed=0, device="cpu", num_envs=1) for _ in range(4)]
    try:
        client = SlowClient()
        waves = [LockstepEnvs(envs[:2]), LockstepEnvs(envs[2:])]
        cols, stats = collect_waves(waves, client, episodes=6, seed=40, tenant="w", episode_offset=2)
        ser = collect_episodes(envs[0], _policy, episodes=6, seed=40, tenant="w", episode_offset=2)
    finally:
        for e in envs:
            e.close()
    for key in ("episode", "step", "state", "action", "reward", "terminated", "truncated", "success",
                "ep_length", "ep_success", "policy_version"):
        np.testing.assert_array_equal(cols[key], ser[key], err_msg=key)
    # one request per wave and step, for that wave's running envs only (2, then 1 at the tail)
    assert max(client.sizes) == 2 and set(client.sizes) <= {1, 2}
    assert stats.requests == len(client.sizes) and stats.rows == len(cols["step"])
    assert stats.sim_s > 0 and stats.action_wait_s > 0
    assert 0 < stats.timed <= stats.requests  # replies that came while the other wave stepped are not timed
    assert stats.engine_wait_s == pytest.approx(0.0005 * stats.timed)
    assert stats.compute_s == pytest.approx(0.001 * stats.timed)
    assert stats.rtt_s >= stats.action_wait_s and stats.messaging_s >= 0
    assert "feature" not in cols  # not asked for


def test_wave_sizes():
    assert rollout.wave_sizes(4, 1) == [4]
    assert rollout.wave_sizes(5, 2) == [3, 2]
    assert rollout.wave_sizes(2, 4) == [1, 1]


def test_producer_mode_follows_the_data_path_and_the_catalog():
    single, vector = catalog.env("maniskill/pushcube-state"), catalog.env("maniskill/pushcube-state-vec2")
    assert rollout.producer_mode(single, "lockstep") == "lockstep"
    assert rollout.producer_mode(single, "async") == "async"
    assert rollout.producer_mode(vector, "lockstep") == "async"  # the entry is an async vector env


def test_prewarm_builds_the_envs_a_rollout_then_checks_out():
    """A worker's pool (a SimHost's, as the SIM task gets it): after prewarm, a producer of the same K and waves
    gets the envs that were built ahead, none new."""
    from nexus.sim import tasks as sim_tasks
    from nexus.sim.host import SimHost

    name = "maniskill/pushcube-state"
    entry = catalog.env(name)
    sim = SimHost()
    pool = sim.pool
    taken = []
    try:
        assert sim_tasks.prewarm(sim, name, 3, waves=2) == 3
        taken.append(built := pool.checkout(entry, rollout.wave_sizes(3, 2), "lockstep"))
        assert [len(g.envs) for g in built] == [2, 1] and pool.idle(name) == 0
        ids = {id(e) for g in built for e in g.envs}
        pool.checkin(entry, taken.pop(), "lockstep")
        assert sim_tasks.prewarm(sim, name, 3, waves=2) == 3  # nothing built twice
        taken.append(again := pool.checkout(entry, [3], "lockstep"))
        assert {id(e) for g in again for e in g.envs} == ids
    finally:
        for groups in taken:
            for g in groups:
                g.close()


class LoopEngine:
    """Calls an in-process engine the way a Dask actor proxy does: each method call returns a
    future with ``result()``; the coroutine runs on the engine's own event loop."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def __getattr__(self, name):
        attr = getattr(self.engine, name)

        def call(*args, **kwargs):
            return asyncio.run_coroutine_threadsafe(attr(*args, **kwargs), self.loop)

        return call

    def call_for(self, tenant: str, method: str, *args, **kwargs):
        """The routed client's call without a tenant argument (one engine here: no routing)."""
        return asyncio.run_coroutine_threadsafe(getattr(self.engine, method)(*args, **kwargs), self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Engine + actor service of one config (tiny Qwen3-VL), tenant slots for a camera env."""
    from nexus.actor.host import ActorHost
    from nexus.actor.tasks import init_tenant
    from nexus.engine.engine import InferenceEngine
    from nexus.wire.messages import TenantSetup

    root = tmp_path_factory.mktemp("stack")
    cfg = ServiceConfig(root=str(root), infer_max_wait_s=0.05)
    engine = LoopEngine(InferenceEngine(cfg))
    svc = ActorHost(cfg)  # this process plays the actor rank
    schema = catalog.env("maniskill/pickcube-rgb").schema
    specs = {}
    for name in ("cached", "recomputed"):  # same seed: the same initial head
        spec = TenantSpec(name=name, env="maniskill/pickcube-rgb", seed=3, hidden_dim=64, lr=1e-3)
        info = init_tenant(svc, TenantSetup(name, spec, schema, str(cfg.tenants_dir / name)))
        engine.register_tenant(spec, schema, info.version, svc.slots[name].export_weights()).result()
        specs[name] = spec
    yield cfg, engine, svc, specs, schema
    engine.close()


def test_cached_features_give_the_same_ppo_update(stack):
    from nexus.actor.tasks import update_rl
    from nexus.sim.host import EnvPool
    from nexus.wire.messages import RLWork

    cfg, engine, svc, specs, schema = stack
    out = TenantOutputDir(str(cfg.tenants_dir / "cached"))
    producer = cfg.datapath.model_copy(update={"envs_per_producer": 2})
    res = rollout.collect(EnvPool(), "cached", "maniskill/pickcube-rgb", str(out.path), schema, episodes=2,
                          seed=11, episode_offset=0, deterministic=False, version=None, engine=engine,
                          job="j", producer=producer)
    assert res.stats["envs"] == 2 and res.stats["requests"] > 0
    assert res.stats["sim_s"] > 0 and res.stats["action_wait_s"] > 0
    table = read_ipc(res.batch.path)
    arrays = table_arrays(table)
    assert arrays["feature"].shape == (len(arrays["step"]), svc.feat_dim)
    assert batch_metadata(table)["feature_key"] == svc.framework.preprocessors["cached"].compat_key

    # the stored features are the backbone's features of the stored observations
    from nexus.data.trajectory_store import table_to_observations

    recomputed, _ = svc.features("cached", table_to_observations(table, schema))
    np.testing.assert_allclose(arrays["feature"], recomputed.pooled.numpy(), atol=1e-5)

    ppo = PPOConfig(update_epochs=2, minibatch_size=32)
    a = update_rl(svc, svc.slots["cached"], RLWork(res.batch, ppo))
    b = update_rl(svc, svc.slots["recomputed"], RLWork(res.batch, ppo, use_cached_features=False))
    assert a["cached_features"] == 1.0 and b["cached_features"] == 0.0
    for k in ("pg_loss", "v_loss", "approx_kl", "entropy"):
        assert a[k] == pytest.approx(b[k], abs=1e-5), k
    pa, pb = svc.slots["cached"].policy.state_dict(), svc.slots["recomputed"].policy.state_dict()
    assert max(float((pa[k] - pb[k]).abs().max()) for k in pa) <= 1e-5
    moved = svc.slots["cached"].policy.state_dict()
    assert any(float((moved[k] - torch.as_tensor(v)).abs().max()) > 0 for k, v in _initial(specs, schema, svc).items())


def _initial(specs, schema, svc) -> dict:
    from nexus.model.policy import TenantPolicy

    return TenantPolicy.from_spec(specs["cached"], schema, svc.feat_dim).state_dict()


def _camera_batch(schema, feat_dim: int, seed: int, n: int = 3) -> dict:
    """A stored RL batch of a camera env with a (constant) cached feature column."""
    rng = np.random.default_rng(seed)
    return {"episode": np.zeros(n, np.int64), "step": np.arange(n, dtype=np.int32),
            "state": rng.normal(size=(n, schema.proprio_dim)).astype(np.float32),
            "image.base_camera": rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8),
            "action": np.zeros((n, 4), np.float32), "reward": np.zeros(n, np.float32),
            "terminated": np.zeros(n, bool), "truncated": np.zeros(n, bool), "success": np.zeros(n, bool),
            "logprob": np.zeros(n, np.float32), "value": np.zeros(n, np.float32),
            "policy_version": np.zeros(n, np.int64), "feature": np.ones((n, feat_dim), np.float32)}


def test_features_of_another_backbone_are_recomputed(stack):
    """A batch whose features came from another backbone (another image size here) is not trusted."""
    from nexus.data.trajectory_store import TrajectoryStore

    cfg, engine, svc, specs, schema = stack
    store = TrajectoryStore(cfg.tenants_dir.parent / "foreign", "cached", schema)
    cols = _camera_batch(schema, svc.feat_dim, seed=0)
    ref = store.append(cols, feature_key="qwen3vl:tiny:float32@128px")
    table = read_ipc(ref.path)
    feats, _, cached = svc.batch_features(svc.slots["cached"], table, table_arrays(table))
    assert not cached and not np.allclose(feats.pooled.numpy(), 1.0)
    with pytest.raises(ValueError, match="feature_key"):
        store.append(cols)  # features without the backbone that made them are refused


def test_feature_column_round_trips_and_plain_readers_drop_it(tmp_path):
    """The cached-feature column is optional: stored and read exactly, ignored by scans and datasets."""
    from nexus.data.offline_dataset import _load_arrow
    from nexus.data.trajectory_store import TrajectoryStore, trajectory_schema
    from tests.test_trajectory_store import SCHEMA, make_columns

    store = TrajectoryStore(tmp_path, "acme", SCHEMA)
    plain = make_columns(seed=1)
    with_f = make_columns(seed=2, first_episode=5) | {"feature": np.arange(8 * 3, dtype=np.float32).reshape(8, 3)}
    store.append(plain)
    ref = store.append(with_f, feature_key="qwen3vl:tiny:float32@64px")
    table = store.read(ref)
    assert table_arrays(table)["feature"].tolist() == with_f["feature"].tolist()
    assert batch_metadata(table)["feature_key"] == "qwen3vl:tiny:float32@64px"
    scanned = store.scan()
    assert scanned.num_rows == 16 and scanned.schema.equals(trajectory_schema(SCHEMA), check_metadata=False)
    entry = dataclasses.replace(next(iter(catalog.datasets().values())), path=tmp_path, schema=SCHEMA, filter={})
    assert len(_load_arrow(entry)["step"]) == 16  # an arrow dataset over RL batches reads them as plain rows
    with pytest.raises(ValueError, match="feature"):
        store.append(make_columns() | {"feature": np.zeros(8, np.float32)}, feature_key="k")  # not [N, H]


def test_a_lora_tenant_recomputes_features_through_its_adapter(stack):
    """Stored rollout features bypass the adapter (and its gradient): a LoRA tenant's update never reads them."""
    from nexus.actor.tasks import init_tenant
    from nexus.data.trajectory_store import TrajectoryStore
    from nexus.spec import LoraConfig
    from nexus.wire.messages import TenantSetup

    cfg, engine, svc, specs, schema = stack
    spec = TenantSpec(name="adapted", env="maniskill/pickcube-rgb", seed=3, hidden_dim=64, lora=LoraConfig(rank=4))
    init_tenant(svc, TenantSetup("adapted", spec, schema, str(cfg.tenants_dir / "adapted")))
    key = svc.framework.preprocessors["adapted"].compat_key
    store = TrajectoryStore(cfg.tenants_dir / "adapted" / "trajectories", "adapted", schema)
    cols = _camera_batch(schema, svc.feat_dim, seed=1)
    table = read_ipc(store.append(cols, feature_key=key).path)
    _, _, cached = svc.batch_features(svc.slots["adapted"], table, table_arrays(table))
    assert not cached  # same backbone key, pooled-only head: a plain tenant would have read the column
    assert svc.framework.preprocessors["cached"].compat_key == key
    _, _, plain_cached = svc.batch_features(svc.slots["cached"], table, table_arrays(table))
    assert plain_cached  # the same batch: the plain tenant's update reads the stored features
