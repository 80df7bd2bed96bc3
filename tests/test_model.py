"""Shared backbone, tenant preprocessors, policies, group batching and the PPO/SFT/GAE algorithms."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from nexus.algorithms.ppo import compute_gae, ppo_loss
from nexus.algorithms.sft import sft_loss
from nexus.features import CameraSpec, Observation, TenantSchema
from nexus.model.action_head import TenantPolicy
from nexus.model.backbone import BackboneConfig
from nexus.model.framework import VLAFramework
from nexus.model.preprocessor import TenantPreprocessor
from nexus.model.qwen3vl import IMAGE_PAD, format_prompt
from nexus.spec import PPOConfig, TenantSpec

torch.set_num_threads(1)

CFG64 = BackboneConfig(size="tiny", image_size=64)

SCHEMAS = {  # tenants with different cameras (count, names, sizes) and none at all
    "two-cams": TenantSchema(proprio_dim=9, action_dim=7, instruction="pick up the red block",
                             cameras=(CameraSpec("base", 128, 128), CameraSpec("wrist", 96, 96))),
    "one-cam": TenantSchema(proprio_dim=4, action_dim=2, instruction="open the top drawer and then close it",
                            cameras=(CameraSpec("front", 64, 80),)),
    "state-only": TenantSchema(proprio_dim=25, action_dim=4, instruction="push the cube to the goal region"),
}


def make_obs(schema: TenantSchema, rng: np.random.Generator, instruction: str = "") -> Observation:
    images = {c.name: rng.integers(0, 256, (c.height, c.width, 3), dtype=np.uint8) for c in schema.cameras}
    return Observation(state=rng.normal(size=schema.proprio_dim).astype(np.float32), images=images,
                       instruction=instruction)


def make_spec(name: str, seed: int = 0, **kw) -> TenantSpec:
    return TenantSpec(name=name, env="maniskill/pushcube-state", seed=seed, hidden_dim=32, **kw)


@pytest.fixture
def framework(tiny_backbone) -> VLAFramework:
    fw = VLAFramework(tiny_backbone)
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        policy = TenantPolicy.from_spec(make_spec(name, seed=i), schema, tiny_backbone.hidden_size)
        fw.add_tenant(name, policy, TenantPreprocessor(schema, CFG64))
    return fw


def mixed_requests(rng: np.random.Generator) -> list[tuple[str, Observation]]:
    """Interleaved tenants, images and no images, default and custom instructions of different lengths."""
    reqs = [("two-cams", make_obs(SCHEMAS["two-cams"], rng)),
            ("state-only", make_obs(SCHEMAS["state-only"], rng)),
            ("one-cam", make_obs(SCHEMAS["one-cam"], rng, "turn on the stove")),
            ("state-only", make_obs(SCHEMAS["state-only"], rng, "x")),
            ("two-cams", make_obs(SCHEMAS["two-cams"], rng, "stack the green block on the yellow block now")),
            ("one-cam", make_obs(SCHEMAS["one-cam"], rng))]
    return reqs


# -- backbone and group batching ---------------------------------------------------------------------


_FINGERPRINT = """
import hashlib, sys
import numpy as np, torch
from nexus.model.backbone import BackboneConfig, SharedBackbone
from nexus.model.qwen3vl import format_prompt
from nexus.features import VLAFeature

def fingerprint(bb):
    h = hashlib.sha256()
    for k, v in bb.model.state_dict().items():
        h.update(k.encode() + v.cpu().numpy().tobytes())
    h.update(repr(sorted(bb.processor.tokenizer.get_vocab().items())).encode())
    img = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    feat = VLAFeature(format_prompt("open the drawer", 1), [img], np.zeros(1, np.float32), bb.compat_key)
    h.update(bb.encode([feat]).numpy().tobytes())
    return h.hexdigest()

if __name__ == "__main__":
    torch.manual_seed(int(sys.argv[1]))  # a different global RNG state must not matter
    print(fingerprint(SharedBackbone(BackboneConfig(size="tiny", image_size=64))))
"""


def test_backbone_is_frozen_and_identical_across_processes(tiny_backbone, tmp_path):
    import runpy
    import subprocess
    import sys

    assert tiny_backbone.hidden_size == 64
    assert not any(p.requires_grad for p in tiny_backbone.model.parameters())
    assert not tiny_backbone.model.training
    # actor and inference workers each build their own copy: weights, vocabulary and features must
    # be bit-identical in another process
    script = tmp_path / "fingerprint.py"
    script.write_text(_FINGERPRINT)
    here = runpy.run_path(str(script))["fingerprint"](tiny_backbone)
    there = subprocess.run([sys.executable, str(script), "123"], capture_output=True, text=True, check=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.split()[-1]
    assert here == there


def test_local_path_checkpoint_gives_the_same_features(tiny_backbone, tmp_path):
    """The from_pretrained path (used with real checkpoints on GPU machines), fed a saved tiny model."""
    from nexus.model.backbone import SharedBackbone

    tiny_backbone.model.save_pretrained(tmp_path)
    tiny_backbone.processor.tokenizer.save_pretrained(tmp_path)
    tiny_backbone.processor.image_processor.save_pretrained(tmp_path)
    cfg = BackboneConfig(local_path=str(tmp_path), image_size=64)
    loaded = SharedBackbone(cfg)
    assert loaded.compat_key != tiny_backbone.compat_key and str(tmp_path) in loaded.compat_key
    schema = SCHEMAS["two-cams"]
    obs = make_obs(schema, np.random.default_rng(9))
    got = loaded.encode([TenantPreprocessor(schema, cfg)(obs)])
    want = tiny_backbone.encode([TenantPreprocessor(schema, CFG64)(obs)])
    assert torch.equal(got, want)
    with pytest.raises(FileNotFoundError):
        SharedBackbone(BackboneConfig(local_path=str(tmp_path / "missing")))


def test_grouped_forward_equals_single_forwards(framework, tiny_backbone):
    rng = np.random.default_rng(0)
    reqs = mixed_requests(rng)
    feats = [framework.preprocess(t, o) for t, o in reqs]
    before = tiny_backbone.forward_calls
    rows = framework.group_encode(list(zip([t for t, _ in reqs], feats, strict=True)))
    assert tiny_backbone.forward_calls == before + 1  # one compatible group -> one forward
    for row, feat in zip(rows, feats, strict=True):
        single = tiny_backbone.encode([feat])[0]
        assert row.shape == (tiny_backbone.hidden_size,) and row.dtype == torch.float32
        assert (row - single).abs().max().item() <= 1e-5
    # rows really differ between samples (no accidental broadcasting)
    assert (rows[1] - rows[3]).abs().max().item() > 1e-3


def test_identical_samples_are_encoded_once(tiny_backbone):
    pre = TenantPreprocessor(SCHEMAS["state-only"], CFG64)
    rng = np.random.default_rng(1)
    feats = [pre(make_obs(SCHEMAS["state-only"], rng)) for _ in range(5)]  # same prompt, no images
    feats.append(pre(make_obs(SCHEMAS["state-only"], rng, "another instruction")))
    before = tiny_backbone.samples_encoded
    out = tiny_backbone.encode(feats)
    assert tiny_backbone.samples_encoded == before + 2
    assert out.shape == (6, tiny_backbone.hidden_size)
    assert all(torch.equal(out[0], out[i]) for i in range(1, 5))
    assert (out[0] - tiny_backbone.encode([feats[0]])[0]).abs().max().item() <= 1e-5


def test_incompatible_keys_run_apart_in_one_call(framework, tiny_backbone):
    cfg96 = BackboneConfig(size="tiny", image_size=96)
    schema = SCHEMAS["one-cam"]
    framework.add_tenant("big-images", TenantPolicy.from_spec(make_spec("big-images"), schema, 64),
                         TenantPreprocessor(schema, cfg96))
    rng = np.random.default_rng(2)
    reqs = mixed_requests(rng)
    reqs.insert(2, ("big-images", make_obs(schema, rng)))
    reqs.append(("big-images", make_obs(schema, rng, "pull the cube")))
    feats = [framework.preprocess(t, o) for t, o in reqs]
    assert feats[2].compat_key == cfg96.compat_key() != CFG64.compat_key() == feats[0].compat_key
    assert feats[2].images[0].shape == (96, 96, 3)

    before = tiny_backbone.forward_calls
    rows = framework.group_encode(list(zip([t for t, _ in reqs], feats, strict=True)))
    assert tiny_backbone.forward_calls == before + 2
    for row, feat in zip(rows, feats, strict=True):
        assert (row - tiny_backbone.encode([feat])[0]).abs().max().item() <= 1e-5

    with pytest.raises(ValueError, match="equal compat keys"):
        tiny_backbone.encode([feats[0], feats[2]])
    other_model = TenantPreprocessor(schema, BackboneConfig(size="small"))
    with pytest.raises(ValueError, match="targets"):
        framework.add_tenant("other", TenantPolicy.from_spec(make_spec("other"), schema, 64), other_model)


def test_group_act_matches_per_tenant_heads_and_pins(framework, tiny_backbone):
    rng = np.random.default_rng(3)
    reqs = mixed_requests(rng)
    out = framework.group_act(reqs, deterministic=True, return_features=True)
    for (tenant, obs), res in zip(reqs, out, strict=True):
        schema = SCHEMAS[tenant]
        assert res["action"].shape == (schema.action_dim,) and res["action"].dtype == np.float32
        assert np.all(np.abs(res["action"]) <= 1.0)
        assert isinstance(res["logprob"], float) and isinstance(res["value"], float)
        feat = tiny_backbone.encode([framework.preprocess(tenant, obs)])
        mean = framework.policies[tenant].mean_action(feat, torch.from_numpy(obs.state[None]))[0]
        np.testing.assert_allclose(res["raw_action"], mean.detach().numpy(), atol=1e-5)
        np.testing.assert_allclose(res["feature"], feat[0].numpy(), atol=1e-5)

    # a pinned (older) policy for one tenant overrides the registered one, others are unaffected
    pinned = TenantPolicy.from_spec(make_spec("two-cams", seed=42), SCHEMAS["two-cams"], 64)
    out_pinned = framework.group_act(reqs, deterministic=True, policies={"two-cams": pinned})
    for (tenant, _), a, b in zip(reqs, out, out_pinned, strict=True):
        same = np.allclose(a["raw_action"], b["raw_action"], atol=1e-6)
        assert same == (tenant != "two-cams")

    # stochastic: samples differ from the mean, clipping applied, logprob is the unclipped sample's
    torch.manual_seed(0)
    sampled = framework.group_act(reqs, deterministic=False)
    assert any(not np.allclose(s["raw_action"], d["raw_action"]) for s, d in zip(sampled, out, strict=True))
    for s in sampled:
        np.testing.assert_array_equal(s["action"], np.clip(s["raw_action"], -1, 1))


# -- preprocessor ----------------------------------------------------------------------------------


def test_preprocessor_standardizes_observations():
    schema = SCHEMAS["two-cams"]
    pre = TenantPreprocessor(schema, CFG64)
    obs = make_obs(schema, np.random.default_rng(4))
    feat = pre(obs)
    assert [im.shape for im in feat.images] == [(64, 64, 3), (64, 64, 3)]
    assert all(im.dtype == np.uint8 for im in feat.images)
    assert feat.prompt == format_prompt(schema.instruction, 2) and feat.prompt.count(IMAGE_PAD) == 2
    assert feat.proprio.dtype == np.float32 and feat.proprio.shape == (9,)
    assert feat.compat_key == CFG64.compat_key()
    obs.instruction = "put the spoon on the towel"
    assert "put the spoon on the towel" in pre(obs).prompt
    assert len(pre.batch([obs, obs])) == 2
    state_only = TenantPreprocessor(SCHEMAS["state-only"], CFG64)(make_obs(SCHEMAS["state-only"],
                                                                           np.random.default_rng(5)))
    assert state_only.images == [] and IMAGE_PAD not in state_only.prompt


def test_preprocessor_rejects_mismatches():
    schema = SCHEMAS["two-cams"]
    pre = TenantPreprocessor(schema, CFG64)
    rng = np.random.default_rng(6)
    obs = make_obs(schema, rng)
    obs.state = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match=r"state has 8 dims.*proprio_dim=9"):
        pre(obs)
    obs = make_obs(schema, rng)
    del obs.images["wrist"]
    with pytest.raises(ValueError, match=r"cameras \['base'\] do not match.*\['base', 'wrist'\]"):
        pre(obs)
    obs = make_obs(schema, rng)
    obs.images["wrist"] = np.zeros((96, 96, 4), np.uint8)
    with pytest.raises(ValueError, match=r"camera 'wrist': image shape \(96, 96, 4\).*\(96, 96, 3\)"):
        pre(obs)
    obs = make_obs(schema, rng)
    obs.images["base"] = np.zeros((128, 128, 3), np.float32)
    with pytest.raises(ValueError, match="dtype float32, expected uint8"):
        pre(obs)
    obs = make_obs(schema, rng)
    obs.state[0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        pre(obs)


# -- policy --------------------------------------------------------------------------------------


def test_policy_shapes_and_deterministic_init():
    schema = TenantSchema(proprio_dim=6, action_dim=3)
    spec = make_spec("p", seed=7, init_log_std=-0.7)
    state = torch.random.get_rng_state()
    a = TenantPolicy.from_spec(spec, schema, feat_dim=16, chunk=4)
    assert torch.equal(state, torch.random.get_rng_state())  # init does not consume the global stream
    b = TenantPolicy.from_spec(spec, schema, feat_dim=16, chunk=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    c = TenantPolicy.from_spec(make_spec("p", seed=8), schema, feat_dim=16, chunk=4)
    assert not torch.equal(a.head.feat_proj.weight, c.head.feat_proj.weight)
    assert torch.allclose(a.head.log_std, torch.full((12,), -0.7))
    with pytest.raises(ValueError, match="action_dim"):
        TenantPolicy.from_spec(make_spec("p", action_dim=5), schema, feat_dim=16)

    feat, proprio = torch.randn(5, 16), torch.randn(5, 6) * 100  # large raw states must stay finite
    action, logprob, value = a.act(feat, proprio)
    assert action.shape == (5, 12) and logprob.shape == (5,) and value.shape == (5,)
    assert a.action_size == 12
    mean, _, _ = a.act(feat, proprio, deterministic=True)
    assert torch.equal(mean, a.mean_action(feat, proprio))
    lp, ent, v = a.evaluate(feat, proprio, action)
    assert lp.shape == ent.shape == v.shape == (5,) and lp.requires_grad
    torch.testing.assert_close(lp, logprob)
    assert torch.isfinite(lp).all() and torch.isfinite(v).all()
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(a.act(feat, proprio, generator=g1)[0], a.act(feat, proprio, generator=g2)[0])


# -- algorithms -----------------------------------------------------------------------------------


@pytest.fixture
def fixed_batch(tiny_backbone):
    """Real backbone features of a tiny fixed batch of one tenant."""
    schema = SCHEMAS["one-cam"]
    pre = TenantPreprocessor(schema, CFG64)
    rng = np.random.default_rng(8)
    feats = [pre(make_obs(schema, rng)) for _ in range(16)]
    x = tiny_backbone.encode(feats)
    proprio = torch.from_numpy(np.stack([f.proprio for f in feats]))
    return schema, x, proprio


def test_sft_loss_falls(fixed_batch):
    schema, feats, proprio = fixed_batch
    policy = TenantPolicy.from_spec(make_spec("sft"), schema, feats.shape[1])
    target = torch.rand(16, schema.action_dim, generator=torch.Generator().manual_seed(0)) * 2 - 1
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    losses = []
    for _ in range(50):
        loss, stats = sft_loss(policy, feats, proprio, target)
        assert stats["mse"] == pytest.approx(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_ppo_loss_falls(fixed_batch):
    schema, feats, proprio = fixed_batch
    policy = TenantPolicy.from_spec(make_spec("ppo"), schema, feats.shape[1])
    torch.manual_seed(0)
    actions, old_logprob, values = policy.act(feats, proprio)
    g = torch.Generator().manual_seed(1)
    advantages, returns = torch.randn(16, generator=g), torch.randn(16, generator=g)
    cfg = PPOConfig(ent_coef=0.01)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    history = []
    for _ in range(8):
        loss, stats = ppo_loss(policy, feats, proprio, actions, old_logprob, advantages, returns, cfg)
        assert set(stats) == {"pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac"}
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append((loss.item(), stats))
    first, last = history[0], history[-1]
    assert first[1]["approx_kl"] == pytest.approx(0.0, abs=1e-6)  # same policy -> ratio 1
    assert first[1]["pg_loss"] == pytest.approx(0.0, abs=1e-5)  # normalized advantages, ratio 1
    assert last[0] < first[0]
    assert last[1]["pg_loss"] < 0 and last[1]["v_loss"] < first[1]["v_loss"]
    assert last[1]["approx_kl"] > 0


def test_compute_gae_hand_example():
    rewards, values = np.array([1.0, 0.0, 2.0]), np.array([0.5, 0.4, 0.3])
    dones = np.array([0.0, 1.0, 0.0])  # episode 1 = steps 0-1 (ends at 1), episode 2 cut after step 2
    gamma, lam = 0.9, 0.8
    # t=2: 2 + 0.9*0.6 - 0.3 = 2.24 ; t=1 (end): 0 - 0.4 = -0.4 ; t=0: 1 + 0.9*0.4 - 0.5 + 0.72*(-0.4)
    adv, ret = compute_gae(rewards, values, dones, 0.6, gamma, lam)
    np.testing.assert_allclose(adv, [0.572, -0.4, 2.24], atol=1e-6)
    np.testing.assert_allclose(ret, [1.072, 0.0, 2.54], atol=1e-6)
    assert adv.dtype == np.float32

    # step 1 was a truncation: bootstrap from the final observation's value 0.7
    adv_t, _ = compute_gae(rewards, values, dones, 0.6, gamma, lam, bootstrap_values=np.array([0, 0.7, 0]))
    np.testing.assert_allclose(adv_t, [0.86 + 0.72 * 0.23, 0.23, 2.24], atol=1e-6)

    # torch in -> torch out; [T, E] equals E separate columns
    r2 = torch.tensor([[1.0, 0.5], [0.0, 1.0], [2.0, -1.0]])
    v2 = torch.tensor([[0.5, 0.1], [0.4, 0.2], [0.3, 0.3]])
    d2 = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    adv2, ret2 = compute_gae(r2, v2, d2, torch.tensor([0.6, 9.9]), gamma, lam)
    assert isinstance(adv2, torch.Tensor) and adv2.shape == (3, 2)
    torch.testing.assert_close(adv2[:, 0], torch.tensor([0.572, -0.4, 2.24]))
    col1, _ = compute_gae(r2[:, 1].numpy(), v2[:, 1].numpy(), d2[:, 1].numpy(), 9.9, gamma, lam)
    np.testing.assert_allclose(adv2[:, 1].numpy(), col1, atol=1e-6)
    torch.testing.assert_close(ret2, adv2 + v2)

    # gamma = lambda = 1, no ends: advantage = sum of future rewards + bootstrap - V_t
    adv1, _ = compute_gae(np.ones(4), np.zeros(4), np.zeros(4), 10.0, 1.0, 1.0)
    np.testing.assert_allclose(adv1, [14, 13, 12, 11])
