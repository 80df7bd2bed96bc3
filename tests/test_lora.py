"""Tenant LoRA adapters on the shared backbone: per-row mixed-adapter grouped forwards (inference and
training), gradient isolation, frozen base weights, DeepSpeed slots, peft's file format."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from nexus.actor.tenant_slot import TenantSlot, grouped_forward_backward
from nexus.algorithms.sft import sft_loss
from nexus.features import CameraSpec, Observation, TenantSchema
from nexus.model.backbone_features import DeferredFeatures
from nexus.model.framework import VLAFramework
from nexus.model.lora import target_regex
from nexus.model.policy import TenantPolicy
from nexus.model.preprocessor import TenantPreprocessor
from nexus.model.synthetic_tenants import CALVIN_LIKE, LIBERO_LIKE, SyntheticTenant
from nexus.spec import LoraConfig, TenantSpec

torch.set_num_threads(1)

ONE_CAM = TenantSchema(proprio_dim=5, action_dim=3, instruction="pick up the cube",
                       cameras=(CameraSpec("front", 64, 80),))
STATE_ONLY = TenantSchema(proprio_dim=9, action_dim=4, instruction="push the cube to the goal region please")
# different ranks, different target sets, and a tenant without LoRA
LORAS = {"r4": LoraConfig(rank=4, alpha=8),
         "r8": LoraConfig(rank=8, alpha=8, target_modules=("q_proj", "v_proj", "o_proj", "down_proj")),
         "r2-mlp": LoraConfig(rank=2, alpha=4, target_modules=("gate_proj", "up_proj")),
         "plain": None}
SCHEMA_OF = {"r4": LIBERO_LIKE, "r8": ONE_CAM, "r2-mlp": STATE_ONLY, "plain": CALVIN_LIKE}


def fingerprint(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode() + v.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def make_spec(name: str, lora: LoraConfig | None, seed: int = 0, family: str = "oft", **kw) -> TenantSpec:
    return TenantSpec(name=name, env="maniskill/pushcube-state", seed=seed, hidden_dim=32, lora=lora,
                      action_head=family, **kw)


def perturb(policy: TenantPolicy, seed: int) -> None:
    """A trained-looking adapter (a fresh one is a no-op: B = 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.lora.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def observations(schema: TenantSchema, n: int, seed: int) -> list[Observation]:
    obs, _ = SyntheticTenant(schema).batch(n, seed)
    return obs


def lora_framework(bb, names=tuple(LORAS), family: str = "oft") -> VLAFramework:
    fw = VLAFramework(bb)
    for i, name in enumerate(names):
        spec = make_spec(name, LORAS[name], seed=i, family=family)
        policy = TenantPolicy.from_spec(spec, SCHEMA_OF[name], bb.hidden_size, lora_shapes=bb.lora_shapes(spec.lora))
        if policy.lora is not None:
            perturb(policy, 100 + i)
        fw.add_tenant(name, policy, TenantPreprocessor(SCHEMA_OF[name], bb.cfg))
    return fw


def test_lora_spec_validation():
    assert TenantSpec(name="a", env="maniskill/pushcube-state").lora is None  # off by default
    cfg = LoraConfig(rank=4, alpha=16)
    assert cfg.scaling == 4.0 and cfg.target_modules == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="unknown LoRA target"):
        LoraConfig(target_modules=("qkv",))  # a vision-tower projection
    with pytest.raises(ValueError, match="repeat"):
        LoraConfig(target_modules=("q_proj", "q_proj"))
    with pytest.raises(ValueError):
        LoraConfig(rank=0)
    with pytest.raises(ValueError):
        LoraConfig(dropout=1.0)


@pytest.mark.parametrize("which", ["qwen3vl", "paligemma"])
def test_adapters_target_the_text_decoder_only(which, tiny_backbone, tiny_paligemma):
    bb = tiny_backbone if which == "qwen3vl" else tiny_paligemma
    cfg = LoraConfig(rank=4, target_modules=("q_proj", "down_proj"))
    shapes = bb.lora_shapes(cfg)
    layers = bb.num_hidden_states - 1
    assert len(shapes) == 2 * layers  # PaliGemma's SigLIP has q_proj too: never adapted
    assert all(n.startswith("language_model.layers.") for n in shapes)
    h = bb.hidden_size
    assert shapes["language_model.layers.0.self_attn.q_proj"][0] == h
    assert shapes["language_model.layers.0.mlp.down_proj"][1] == h
    assert bb.lora_shapes(None) is None


def test_fresh_adapter_is_a_no_op_and_plain_groups_are_untouched(tiny_backbone):
    bb = tiny_backbone
    spec = make_spec("fresh", LoraConfig(rank=4))
    policy = TenantPolicy.from_spec(spec, ONE_CAM, bb.hidden_size, lora_shapes=bb.lora_shapes(spec.lora))
    plain = TenantPolicy.from_spec(make_spec("fresh", None), ONE_CAM, bb.hidden_size)
    # the head initialises the same with and without LoRA (the adapter is built last)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, policy.state_dict()[k])
    feats = TenantPreprocessor(ONE_CAM, bb.cfg).batch(observations(ONE_CAM, 3, 0))
    base = bb.encode_prefix(feats, layers=(-1,))
    with_fresh = bb.encode_prefix(feats, layers=(-1,), adapters=[policy.lora] * 3)
    assert torch.equal(base.pooled, with_fresh.pooled) and torch.equal(base.tokens, with_fresh.tokens)
    perturb(policy, 0)
    adapted = bb.encode_prefix(feats, adapters=[policy.lora, None, policy.lora])
    assert not torch.allclose(adapted.pooled[0], base.pooled[0], atol=1e-3)
    assert torch.equal(adapted.pooled[1], base.pooled[1])  # a row without an adapter: exactly the base output
    assert torch.equal(bb.encode_prefix(feats).pooled, base.pooled)  # nothing left behind by the route

    # rows of one adapter scattered through the batch (the router's gather / scatter-add path) == the
    # contiguous layout encode_prefix sorts rows into
    other = TenantPolicy.from_spec(make_spec("other", LoraConfig(rank=2), seed=1), ONE_CAM, bb.hidden_size,
                                   lora_shapes=bb.lora_shapes(LoraConfig(rank=2)))
    perturb(other, 1)
    mixed = [policy.lora, other.lora, policy.lora]
    with bb.router.route(mixed, bb.device):
        scattered = bb._forward(bb.family.prepare(feats), ())
    torch.testing.assert_close(scattered.pooled, bb.encode_prefix(feats, adapters=mixed).pooled, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["oft", "groot"])
def test_mixed_adapter_group_equals_per_tenant_forwards(family, tiny_backbone):
    """One forward for four tenants (ranks 4 / 8 / 2 on different projections, one without LoRA) ==
    each tenant alone, in float32, for pooled features and prefix tokens; the base model stays frozen."""
    bb = tiny_backbone
    fw = lora_framework(bb, family=family)
    before = fingerprint(bb.model)
    reqs = []
    for k in range(3):
        for i, name in enumerate(LORAS):
            reqs += [(name, o) for o in observations(SCHEMA_OF[name], 1 + (k + i) % 2, 10 * k + i)]
    feats = [fw.preprocess(t, o) for t, o in reqs]
    calls = bb.forward_calls
    grouped = fw.group_features([(t, f) for (t, _), f in zip(reqs, feats, strict=True)])
    assert bb.forward_calls == calls + 1, "adapters must not split a compatible group"
    for name, (idx, got) in grouped.items():
        alone = fw.group_features([(name, feats[i]) for i in idx])[name][1]
        torch.testing.assert_close(got.pooled, alone.pooled, rtol=0, atol=1e-5)
        if family == "groot":
            assert got.tokens is not None
            torch.testing.assert_close(got.tokens, alone.tokens, rtol=0, atol=1e-5)
        # and each adapter really acts: the same rows without it differ
        if fw.policies[name].lora is not None:
            base = bb.encode([feats[i] for i in idx])
            assert (base - got.pooled).abs().max() > 1e-3
    # actions too (each head on its own rows)
    acts = fw.group_act(reqs, deterministic=True)
    for (name, obs), a in zip(reqs, acts, strict=True):
        assert np.allclose(a["action"], fw.group_act([(name, obs)], deterministic=True)[0]["action"], atol=1e-5)
    assert fingerprint(bb.model) == before


def test_mixed_adapters_across_families_of_backbones(tiny_paligemma):
    fw = lora_framework(tiny_paligemma, family="pi")
    reqs = [(name, o) for i, name in enumerate(LORAS) for o in observations(SCHEMA_OF[name], 2, i)]
    feats = [fw.preprocess(t, o) for t, o in reqs]
    grouped = fw.group_features([(t, f) for (t, _), f in zip(reqs, feats, strict=True)])
    for name, (idx, got) in grouped.items():
        alone = fw.group_features([(name, feats[i]) for i in idx])[name][1]
        torch.testing.assert_close(got.tokens, alone.tokens, rtol=0, atol=1e-5)


def test_gradients_reach_only_each_tenants_own_adapter(tiny_backbone):
    """Grouped training forward (autograd, train mode — what peft refuses for mixed adapters)."""
    bb = tiny_backbone
    names = ("r4", "r8", "r2-mlp")
    fw = lora_framework(bb, names)
    data = {n: observations(SCHEMA_OF[n], 3, i) for i, n in enumerate(names)}
    targets = {n: torch.randn(3, SCHEMA_OF[n].action_dim, generator=torch.Generator().manual_seed(i))
               for i, n in enumerate(names)}
    reqs = [(n, f) for n in names for f in fw.preprocessors[n].batch(data[n])]
    proprio = {n: torch.from_numpy(np.stack([f.proprio for t, f in reqs if t == n])) for n in names}
    policies = {n: fw.policies[n].train() for n in names}

    def zero():
        for p in policies.values():
            p.zero_grad(set_to_none=True)

    def adapter_grads(n):
        return [None if p.grad is None else p.grad.clone() for p in policies[n].lora.parameters()]

    # (1) only tenant r4's loss: nobody else's adapter gets a gradient
    zero()
    grouped = fw.group_features(reqs, grad=True)
    loss, _ = sft_loss(policies["r4"], grouped["r4"][1], proprio["r4"], targets["r4"])
    loss.backward()
    assert all(g is not None and g.abs().sum() > 0 for g in adapter_grads("r4")[1::2])  # lora_B of every layer
    for other in ("r8", "r2-mlp"):
        assert all(g is None or not g.any() for g in adapter_grads(other))
    assert not any(p.requires_grad for p in bb.model.parameters())

    # (2) all losses summed over one grouped forward == each tenant's own forward and backward
    zero()
    grouped = fw.group_features(reqs, grad=True)
    sum(sft_loss(policies[n], grouped[n][1], proprio[n], targets[n])[0] for n in names).backward()
    together = {n: adapter_grads(n) for n in names}
    for n in names:
        zero()
        alone = fw.group_features([(t, f) for t, f in reqs if t == n], grad=True)[n][1]
        sft_loss(policies[n], alone, proprio[n], targets[n])[0].backward()
        for a, b in zip(together[n], adapter_grads(n), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("family", ["oft", "groot"])
def test_grouped_training_through_engines_equals_serial_and_base_never_changes(family, tiny_backbone):
    """Many steps of several tenants' slots (own DeepSpeed ZeRO-2 engines, adapters inside): one grouped
    forward/backward per step == each tenant trained alone; the backbone stays bit-identical. GR00T heads
    read prefix tokens: their gradients go back through the backbone too."""
    bb = tiny_backbone
    names = ("r4", "r8", "plain")
    before = fingerprint(bb.model)
    data = {n: (observations(SCHEMA_OF[n], 4, i), torch.randn(4, SCHEMA_OF[n].action_dim,
                                                                 generator=torch.Generator().manual_seed(i)))
            for i, n in enumerate(names)}

    def build():
        fw, slots = VLAFramework(bb), []
        for i, n in enumerate(names):
            spec = make_spec(n, LORAS[n], seed=i, lr=1e-2, family=family)
            slot = TenantSlot(spec, SCHEMA_OF[n], bb.hidden_size, lora_shapes=bb.lora_shapes(spec.lora))
            fw.add_tenant(n, slot.policy, TenantPreprocessor(SCHEMA_OF[n], bb.cfg))
            slots.append(slot)
        return fw, slots

    def loss(n: str, step: int):  # flow-matching noise from a fresh generator: the same in both modes, every step
        return lambda p, f, pr: sft_loss(p, f, pr, data[n][1], torch.Generator().manual_seed(len(n)))

    (fw_g, grouped), (fw_s, serial) = build(), build()
    init = {s.name: {k: v.clone() for k, v in s.policy.state_dict().items()} for s in grouped}
    first = None
    for step in range(4):
        g_stats = grouped_forward_backward(fw_g, [(s, data[s.name][0], loss(s.name, step)) for s in grouped])
        for s in grouped:
            s.optim_step()
        s_stats = []
        for s in serial:
            feats, pr = fw_s.tenant_features(s.name, data[s.name][0])
            assert isinstance(feats, DeferredFeatures) == (s.policy.lora is not None)
            s_stats.append(s.train_step(lambda p, feats=feats, pr=pr, fn=loss(s.name, step): fn(p, feats, pr)))
        assert [x["loss"] for x in g_stats] == pytest.approx([x["loss"] for x in s_stats], rel=1e-5)
        first = first or g_stats
    assert all(last["loss"] < f["loss"] for f, last in zip(first, g_stats, strict=True))
    for g, s in zip(grouped, serial, strict=True):
        gs, ss = g.policy.state_dict(), s.policy.state_dict()
        for k in gs:
            # Adam turns float noise in near-zero gradients into moves up to lr (1e-2): allow a tenth of one step
            torch.testing.assert_close(gs[k], ss[k], rtol=1e-4, atol=1e-3)
        if g.policy.lora is not None:
            moved = [k for k in gs if k.startswith("lora.") and not torch.equal(gs[k], init[g.name][k])]
            assert moved, f"{g.name}: the adapter did not train"
    assert fingerprint(bb.model) == before, "the shared backbone's weights changed"
    assert not any(p.requires_grad for p in bb.model.parameters())


def test_adapted_features_follow_the_adapter_and_select_rows(tiny_backbone):
    bb = tiny_backbone
    fw = lora_framework(bb, ("r4",))
    obs = observations(LIBERO_LIKE, 5, 3)
    feats, proprio = fw.tenant_features("r4", obs)
    assert isinstance(feats, DeferredFeatures) and len(feats) == 5 and proprio.shape == (5, 8)
    policy = fw.policies["r4"]
    full = feats.compute(policy)
    rows = torch.tensor([3, 0])
    torch.testing.assert_close(feats[rows].compute(policy).pooled, full.pooled[[3, 0]], rtol=0, atol=1e-5)
    torch.testing.assert_close(feats[1:3].compute(policy).pooled, full.pooled[1:3], rtol=0, atol=1e-5)
    with torch.no_grad():
        assert not feats.compute(policy).pooled.requires_grad
    assert feats.compute(policy).pooled.requires_grad  # grad mode on: the graph reaches the adapter
    perturb(policy, 7)  # the adapter moved: the same deferred batch now reads new features
    assert (feats.compute(policy).pooled - full.pooled).abs().max() > 1e-3


def test_inference_engine_serves_live_and_pinned_adapters_in_one_group(tiny_backbone, tmp_path):
    """``InferenceEngine._forward``: a pinned version's adapter next to the live one and a plain tenant."""
    from nexus.engine.engine import InferenceEngine, _Request

    bb = tiny_backbone
    engine = InferenceEngine({"root": str(tmp_path)})
    fw = engine.heads.framework = lora_framework(bb, ("r4", "plain"))
    pinned = TenantPolicy.from_spec(make_spec("r4", LORAS["r4"]), LIBERO_LIKE, bb.hidden_size,
                                    lora_shapes=bb.lora_shapes(LORAS["r4"]))
    pinned.load_state_dict(fw.policies["r4"].state_dict())
    perturb(pinned, 55)  # version 1 and the live version 2 differ in their adapter only
    for p_live, p_old in zip(fw.policies["r4"].head.parameters(), pinned.head.parameters(), strict=True):
        assert torch.equal(p_live, p_old)
    engine.heads.live = {"r4": (2, fw.policies["r4"]), "plain": (0, fw.policies["plain"])}
    engine.heads.pinned = {("r4", 1): [pinned.eval(), 1]}
    o = observations(LIBERO_LIKE, 2, 1)  # the same observation under the live and the pinned adapter
    group = [_Request("r4", obs, v, True, job=None)
             for obs, v in zip([o[0], o[0], o[1], o[1]], [None, 1, 2, 1], strict=True)]
    group += [_Request("plain", o, None, True, job=None)
              for o in observations(CALVIN_LIKE, 2, 2)]
    calls = bb.forward_calls
    outs = engine._forward(group)
    assert bb.forward_calls == calls + 1
    for r, out in zip(group, outs, strict=True):
        policy = pinned if r.version == 1 else fw.policies[r.tenant]
        want = fw.group_act([(r.tenant, r.obs)], deterministic=True, policies={r.tenant: policy})[0]["raw_action"]
        np.testing.assert_allclose(out["action"], want, atol=1e-5)
        assert out["version"] == (r.version or engine.heads.live[r.tenant][0])
    assert np.abs(outs[0]["action"] - outs[1]["action"]).max() > 1e-4  # same sample, two adapters: not merged


def test_peft_loads_the_exported_adapter_and_agrees(tiny_backbone, tmp_path):
    """Our adapter in peft's file format: ``PeftModel.from_pretrained`` onto the same backbone gives the
    same features as our per-row application."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel
    from safetensors.torch import save_file

    from nexus.model.backbone import SharedBackbone

    bb = tiny_backbone
    fw = lora_framework(bb, ("r8",))
    adapter = fw.policies["r8"].lora
    cfg = adapter.peft_config(base_model_class=type(bb.model).__name__)
    cfg.save_pretrained(str(tmp_path))
    save_file(adapter.peft_state_dict(), str(tmp_path / "adapter_model.safetensors"))
    loaded_cfg = PeftLoraConfig.from_pretrained(str(tmp_path))
    assert loaded_cfg.r == 8 and loaded_cfg.target_modules == target_regex(LORAS["r8"])

    other = SharedBackbone(bb.cfg)  # a second copy, wrapped by peft
    other.family.model = PeftModel.from_pretrained(other.model, str(tmp_path)).eval()
    n_lora = sum(1 for n, _ in other.family.model.named_modules() if n.endswith(".lora_A.default"))
    assert n_lora == len(adapter.module_names)
    feats = TenantPreprocessor(ONE_CAM, bb.cfg).batch(observations(ONE_CAM, 3, 4))
    ours = bb.encode_prefix(feats, layers=(-1,), adapters=[adapter] * 3)
    with torch.no_grad():
        theirs = other._features(other.family.prepare(feats), (-1,))
    torch.testing.assert_close(theirs.pooled, ours.pooled, rtol=0, atol=1e-5)
    torch.testing.assert_close(theirs.tokens, ours.tokens, rtol=0, atol=1e-5)


def test_lora_slot_checkpoint_restores_adapter_and_optimizer(tiny_backbone, tmp_path):
    """A LoRA tenant's DeepSpeed checkpoint holds its adapter and the adapter's AdamW state: a restored slot
    takes the identical next step."""
    bb = tiny_backbone
    spec = make_spec("r8", LORAS["r8"], lr=1e-2)
    obs, targets = observations(ONE_CAM, 4, 5), torch.randn(4, ONE_CAM.action_dim)

    def slot_and_framework():
        slot = TenantSlot(spec, ONE_CAM, bb.hidden_size, lora_shapes=bb.lora_shapes(spec.lora))
        fw = VLAFramework(bb)
        fw.add_tenant("r8", slot.policy, TenantPreprocessor(ONE_CAM, bb.cfg))
        return slot, fw

    def step(slot, fw):
        feats, proprio = fw.tenant_features("r8", obs)
        return slot.train_step(lambda p: sft_loss(p, feats, proprio, targets))

    a, fw_a = slot_and_framework()
    for _ in range(3):
        step(a, fw_a)
    a.bump_version()
    a.save_checkpoint(str(tmp_path))
    b, fw_b = slot_and_framework()
    b.load_checkpoint(str(tmp_path))
    assert b.version == 1
    for (k, va), vb in zip(a.policy.state_dict().items(), b.policy.state_dict().values(), strict=True):
        assert torch.equal(va, vb), k
    assert any(k.startswith("lora.") for k in b.policy.state_dict())
    step(a, fw_a), step(b, fw_b)
    for (k, va), vb in zip(a.policy.state_dict().items(), b.policy.state_dict().values(), strict=True):
        assert torch.equal(va, vb), f"{k} diverged after restore"
