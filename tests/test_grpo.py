"""GRPO as a job's algorithm (``RLJob(algorithm="grpo")``), below the service: the group-relative advantages,
rollouts grouped by reset seed in a real ManiSkill env, the job spec's checks, and the actor's update on a real
DeepSpeed slot with its KL reference read from the tenant's stored version (no cluster; the service-level job runs
in ``tests/test_tinker.py``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from nexus.algorithms.grpo import GRPOConfig, batch_advantages, group_advantages, process_advantages
from nexus.config import catalog
from nexus.config.service import ServiceConfig, ServiceLimits
from nexus.config.validation import validate_job
from nexus.errors import LimitExceeded, NotFound, SpecError
from nexus.sim.environment import LockstepEnvs, PolicyClient, PolicyOutput, collect_waves, make_env
from nexus.spec import RLJob, TenantSpec

torch.set_num_threads(1)
PUSH = "maniskill/pushcube-state"


def test_outcome_advantages_standardize_each_episode_return_in_its_group():
    # 4 episodes of 2 steps, groups {0, 1} and {2, 3}: returns 1, 3 | 2, 2
    arrays = {"episode": np.array([0, 0, 1, 1, 2, 2, 3, 3]),
              "reward": np.array([0.5, 0.5, 1.0, 2.0, 1.0, 1.0, 2.0, 0.0], np.float32)}
    adv = batch_advantages(arrays, GRPOConfig(group_size=2, advantage="outcome"))
    np.testing.assert_allclose(adv, [-1, -1, 1, 1, 0, 0, 0, 0], atol=1e-5)  # an all-equal group teaches nothing
    np.testing.assert_allclose(group_advantages(np.array([1.0, 3.0]), np.array([0, 0])), [-1, 1], atol=1e-5)


def test_process_advantages_sum_the_group_normalized_rewards_from_each_step():
    episodes = np.array([0, 0, 1, 1])
    rewards = np.array([1.0, 0.0, 0.0, 1.0])  # group mean 0.5, std 0.5: normalized +1 -1 -1 +1
    np.testing.assert_allclose(process_advantages(rewards, episodes, np.zeros(4), gamma=1.0), [0, -1, 0, 1], atol=1e-5)
    np.testing.assert_allclose(process_advantages(rewards, episodes, np.zeros(4), gamma=0.5), [0.5, -1, -0.5, 1],
                               atol=1e-5)
    arrays = {"episode": episodes, "reward": rewards}
    np.testing.assert_allclose(batch_advantages(arrays, GRPOConfig(group_size=2, advantage="process")),
                               [0, -1, 0, 1], atol=1e-5)


def test_grpo_job_spec_checks():
    spec = TenantSpec(name="g", env=PUSH)
    job = validate_job(spec, {"kind": "rl", "algorithm": "grpo", "episodes_per_batch": 8, "grpo": {"group_size": 4}})
    assert job.algorithm == "grpo" and job.group_size == 4 and RLJob().group_size == 1
    with pytest.raises(SpecError, match="not a multiple of grpo.group_size=4"):
        validate_job(spec, {"kind": "rl", "algorithm": "grpo", "episodes_per_batch": 6, "grpo": {"group_size": 4}})
    with pytest.raises(SpecError, match="group_size"):
        validate_job(spec, {"kind": "rl", "algorithm": "grpo", "grpo": {"group_size": 1}})
    with pytest.raises(SpecError, match="algorithm"):
        validate_job(spec, {"kind": "rl", "algorithm": "a2c"})
    with pytest.raises(LimitExceeded, match="grpo.update_epochs"):
        validate_job(spec, {"kind": "rl", "algorithm": "grpo", "episodes_per_batch": 4,
                            "grpo": {"update_epochs": 99}}, ServiceLimits())
    lora = TenantSpec(name="l", env=PUSH, lora={"rank": 4})
    with pytest.raises(SpecError, match="kl_coef needs a heads-only tenant"):
        validate_job(lora, {"kind": "rl", "algorithm": "grpo", "episodes_per_batch": 4, "grpo": {"kl_coef": 0.1}})


def _policy(obs) -> PolicyOutput:
    return PolicyOutput(action=np.tanh(obs.state[:4] * 3).astype(np.float32), logprob=-1.0, value=0.0, version=0)


def test_a_group_of_episodes_starts_from_one_reset_seed():
    entry = dataclasses.replace(catalog.env(PUSH), max_episode_steps=3)
    envs = [make_env(entry, seed=0, device="cpu", num_envs=1) for _ in range(2)]
    try:
        cols, _ = collect_waves([LockstepEnvs(envs)], PolicyClient(_policy), episodes=4, seed=500, tenant="g",
                                episode_offset=4, group_size=2)
    finally:
        for e in envs:
            e.close()
    first = {int(e): cols["state"][(cols["episode"] == e) & (cols["step"] == 0)][0] for e in (4, 5, 6, 7)}
    np.testing.assert_array_equal(first[4], first[5])  # seed 500 + 4 // 2 for both
    np.testing.assert_array_equal(first[6], first[7])
    assert not np.array_equal(first[4], first[6])  # the next group starts elsewhere
    assert sorted(np.unique(cols["episode"])) == [4, 5, 6, 7]  # episode ids stay unique


@pytest.fixture(scope="module")
def actor(tmp_path_factory):
    """An actor rank in this process (tiny Qwen3-VL backbone) with one heads-only PushCube tenant."""
    from nexus.actor.host import ActorHost
    from nexus.actor.tasks import init_tenant
    from nexus.wire.messages import TenantSetup

    cfg = ServiceConfig(root=str(tmp_path_factory.mktemp("grpo")))
    host = ActorHost(cfg)
    schema = catalog.env(PUSH).schema
    spec = TenantSpec(name="g", env=PUSH, seed=3, hidden_dim=64, lr=1e-2)
    setup = TenantSetup("g", spec, schema, str(cfg.tenants_dir / "g"))
    init_tenant(host, setup)
    return host, setup


def _stored_batch(setup, episodes: int = 4, steps: int = 6):
    from nexus.data.trajectory_store import TrajectoryStore

    rng = np.random.default_rng(0)
    n = episodes * steps
    cols = {"episode": np.repeat(np.arange(episodes), steps),
            "step": np.tile(np.arange(steps), episodes).astype(np.int32),
            "state": rng.normal(size=(n, setup.schema.proprio_dim)).astype(np.float32),
            "action": rng.normal(size=(n, 4)).astype(np.float32),
            "reward": rng.uniform(0, 1, n).astype(np.float32), "terminated": np.zeros(n, bool),
            "truncated": np.arange(n) % steps == steps - 1, "success": np.zeros(n, bool),
            "logprob": np.full(n, -4.0, np.float32), "value": np.zeros(n, np.float32),
            "policy_version": np.zeros(n, np.int64)}
    return TrajectoryStore(setup.output_dir + "/trajectories", "g", setup.schema).append(cols)


def test_grpo_update_trains_the_head_not_the_critic_with_a_kl_to_the_stored_reference(actor):
    from nexus.actor.tasks import UPDATES
    from nexus.wire.messages import GRPOWork

    host, setup = actor
    slot = host.slots["g"]
    before = {k: v.clone() for k, v in slot.policy.state_dict().items()}
    cfg = GRPOConfig(group_size=2, kl_coef=0.5, update_epochs=2, minibatch_size=8)
    metrics = UPDATES[GRPOWork](host, slot, GRPOWork(_stored_batch(setup), cfg, ref_version=0), setup.output_dir)
    assert metrics["batch_steps"] == 24 and metrics["epochs"] == 2 and metrics["cached_features"] == 0.0
    assert metrics["group_return_std"] > 0
    assert metrics["kl_ref"] > 0  # the head left version 0, the reference, after the first minibatch
    after = slot.policy.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(k.startswith("head.") for k in moved), moved
    assert not any(k.startswith("value.") for k in moved), moved  # no critic: the value head is untouched
    ref = host.reference(slot, setup.output_dir, 0)
    assert all(torch.equal(ref.state_dict()[k], before[k]) for k in before)  # version 0's weights, frozen
    with pytest.raises(NotFound, match="no weights"):
        UPDATES[GRPOWork](host, slot, GRPOWork(_stored_batch(setup), cfg, ref_version=77), setup.output_dir)
