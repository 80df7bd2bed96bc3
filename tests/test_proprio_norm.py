"""A tenant's proprio normalization (``TenantSpec.proprio_norm``, ``nexus.model.proprio_norm``): running statistics
that merge like one pass over all states, travel with the weights, and move only after the update that trained on
a batch (on a real actor rank with its DeepSpeed slot; no cluster)."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch

from nexus.algorithms.ppo import PPOConfig
from nexus.config import catalog
from nexus.config.service import ServiceConfig
from nexus.config.validation import validate_tenant
from nexus.export.policy import proprio_normalization
from nexus.features import TenantSchema
from nexus.model.policy import TenantPolicy
from nexus.model.proprio_norm import CLIP, MIN_VAR, RunningProprio
from nexus.spec import TenantSpec

torch.set_num_threads(1)
PUSH = "maniskill/pushcube-state"
FEAT = 64  # the tiny Qwen3-VL's width


def test_running_statistics_merge_batches_as_one_pass_and_standardize():
    rng = np.random.default_rng(0)
    states = rng.normal(loc=[0.1, -2.0, 5.0], scale=[0.02, 1.0, 3.0], size=(300, 3))
    norm = RunningProprio(3)
    x = torch.tensor([[0.5, -0.5, 9.0]])  # nothing seen yet: ~the identity, clipped
    torch.testing.assert_close(norm(x), (x / (1 + MIN_VAR) ** 0.5).clamp(-CLIP, CLIP))
    for part in (states[:7], states[7:150], states[150:]):
        norm.observe(part)
    assert int(norm.count) == 300 and norm.count.dtype == torch.long
    np.testing.assert_allclose(norm.mean.numpy(), states.mean(0), rtol=1e-5)
    np.testing.assert_allclose(norm.var.numpy(), states.var(0), rtol=1e-4)
    z = norm(torch.as_tensor(states, dtype=torch.float32)).numpy()
    np.testing.assert_allclose(z.mean(0), 0, atol=1e-4)
    assert z.std(0)[1] == pytest.approx(1.0, abs=1e-3)  # MIN_VAR is nothing next to a variance of 1
    assert z.std(0)[0] == pytest.approx(0.02 / np.sqrt(0.02**2 + MIN_VAR), rel=0.05)  # the floor damps a tiny spread
    assert norm(torch.tensor([[0.1, 100.0, 5.0]]))[0, 1] == CLIP
    norm.observe(np.zeros((0, 3)))  # an empty batch changes nothing
    assert int(norm.count) == 300


def _policy(norm: str) -> tuple[TenantPolicy, TenantSpec, TenantSchema]:
    spec, schema = validate_tenant(TenantSpec(name="n", env=PUSH, hidden_dim=32, proprio_norm=norm))
    return TenantPolicy.from_spec(spec, schema, FEAT), spec, schema


def test_the_statistics_travel_with_the_weights_and_tanh_tenants_keep_their_state_dict():
    assert not any(k.startswith("proprio_norm.") for k in _policy("tanh")[0].state_dict())  # stored weights load
    p, spec, schema = _policy("running")
    assert {"proprio_norm.mean", "proprio_norm.var", "proprio_norm.count"} <= set(p.state_dict())
    states = np.random.default_rng(1).normal(0.3, 0.05, size=(64, 35))
    p.proprio_norm.observe(states)
    buf = io.BytesIO()
    torch.save(p.state_dict(), buf)
    q = TenantPolicy.from_bytes(buf.getvalue(), spec, schema, FEAT)
    assert int(q.proprio_norm.count) == 64
    feat, proprio = torch.randn(4, FEAT), torch.as_tensor(states[:4], dtype=torch.float32)
    torch.testing.assert_close(q.act(feat, proprio, deterministic=True)[0], p.act(feat, proprio, deterministic=True)[0])
    described = proprio_normalization(spec, p.state_dict())  # an export's normalization.json
    assert described["transform"] == "running" and described["count"] == 64
    np.testing.assert_allclose(described["mean"], states.mean(0), rtol=1e-5)
    assert proprio_normalization(spec.model_copy(update={"proprio_norm": "tanh"}), {})["transform"] == "tanh"
    fresh = copy.deepcopy(p)  # the same weights without the statistics: the head reads other numbers
    fresh.proprio_norm.count.zero_()
    fresh.proprio_norm.mean.zero_()
    fresh.proprio_norm.var.fill_(1.0)
    assert not torch.allclose(fresh.act(feat, proprio, deterministic=True)[0],
                              p.act(feat, proprio, deterministic=True)[0])


@pytest.fixture(scope="module")
def actor(tmp_path_factory):
    """An actor rank in this process (tiny Qwen3-VL backbone) with one heads-only PushCube tenant, running norm."""
    from nexus.actor.host import ActorHost
    from nexus.actor.tasks import init_tenant
    from nexus.wire.messages import TenantSetup

    cfg = ServiceConfig(root=str(tmp_path_factory.mktemp("norm")))
    host = ActorHost(cfg)
    schema = catalog.env(PUSH).schema
    spec = TenantSpec(name="r", env=PUSH, seed=3, hidden_dim=64, lr=1e-2, proprio_norm="running")
    setup = TenantSetup("r", spec, schema, str(cfg.tenants_dir / "r"))
    init_tenant(host, setup)
    return host, setup


def test_an_update_scores_its_batch_with_the_statistics_it_was_collected_under_then_folds_it_in(actor):
    from nexus.actor.tasks import UPDATES
    from nexus.data.trajectory_store import TrajectoryStore, read_batch, table_arrays
    from nexus.wire.messages import RLWork

    host, setup = actor
    slot = host.slots["r"]
    episodes, steps = 4, 6
    n = episodes * steps
    rng = np.random.default_rng(0)
    cols = {"episode": np.repeat(np.arange(episodes), steps),
            "step": np.tile(np.arange(steps), episodes).astype(np.int32),
            "state": rng.normal(0.05, 0.02, size=(n, setup.schema.proprio_dim)).astype(np.float32),
            "action": rng.normal(size=(n, 4)).astype(np.float32),
            "reward": rng.uniform(0, 1, n).astype(np.float32), "terminated": np.zeros(n, bool),
            "truncated": np.arange(n) % steps == steps - 1, "success": np.zeros(n, bool),
            "logprob": np.zeros(n, np.float32), "value": np.zeros(n, np.float32),
            "policy_version": np.zeros(n, np.int64)}
    store = TrajectoryStore(setup.output_dir + "/trajectories", "r", setup.schema)
    probe = store.append(cols)
    table = read_batch(probe)
    feats, proprio, _ = host.batch_features(slot, table, table_arrays(table), False)
    with torch.no_grad():  # the behaviour log-probs: the slot's own policy under its current (empty) statistics
        cols["logprob"] = slot.policy.evaluate(feats, proprio, torch.as_tensor(cols["action"]))[0].numpy()
    batch = store.append(cols)
    assert int(slot.policy.proprio_norm.count) == 0
    cfg = PPOConfig(update_epochs=1, minibatch_size=n)  # one minibatch: its approx KL is the first one's
    metrics = UPDATES[RLWork](host, slot, RLWork(batch, cfg, use_cached_features=False), setup.output_dir)
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-6)  # scored as collected: ratio 1
    norm = slot.policy.proprio_norm
    assert int(norm.count) == n
    np.testing.assert_allclose(norm.mean.numpy(), cols["state"].mean(0), rtol=1e-4, atol=1e-6)
    published = TenantPolicy.from_bytes(slot.export_weights(), setup.spec, setup.schema, host.feat_dim)
    torch.testing.assert_close(published.proprio_norm.mean, norm.mean)  # the engines get them with the weights


def test_sft_steps_fold_in_their_batches_states(tmp_path):
    """An SFT tenant's statistics settle on its dataset's states (RL after SFT reads the scale SFT trained at)."""
    from nexus.actor.host import ActorHost
    from nexus.actor.tasks import update_sft
    from nexus.actor.tenant_slot import TenantSlot
    from nexus.model.preprocessor import TenantPreprocessor
    from nexus.wire.messages import SFTWork

    host = ActorHost(ServiceConfig(root=str(tmp_path)))
    schema = catalog.dataset("pickcube-scripted").schema
    spec = TenantSpec(name="s", dataset="pickcube-scripted", hidden_dim=32, proprio_norm="running", seed=5)
    host.slots["s"] = slot = TenantSlot(spec, schema, host.feat_dim)
    host.framework.add_tenant("s", slot.policy, TenantPreprocessor(schema, host.backbone_cfg))
    states = [host.dataset("pickcube-scripted").sample_batch(8, step, spec.seed)["state"] for step in (0, 1)]
    for step in (0, 1):
        update_sft(host, slot, SFTWork("pickcube-scripted", step, 8))
    norm = slot.policy.proprio_norm
    assert int(norm.count) == 16
    np.testing.assert_allclose(norm.mean.numpy(), np.concatenate(states).mean(0), rtol=1e-4, atol=1e-6)
