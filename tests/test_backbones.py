"""Backbone families (Qwen3-VL, PaliGemma), prefix features and the group-batching compatibility rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nexus.config.service import ServiceConfig
from nexus.features import CameraSpec, Observation, TenantSchema
from nexus.model.backbone import BackboneConfig, SharedBackbone, check, compatible
from nexus.model.backbone_features import BackboneFeatures
from nexus.model.framework import VLAFramework
from nexus.model.paligemma import IMAGE_TOKEN
from nexus.model.policy import TenantPolicy
from nexus.model.preprocessor import TenantPreprocessor
from nexus.model.synthetic_tenants import CALVIN_LIKE, LIBERO_LIKE, SyntheticTenant
from nexus.spec import TenantSpec

torch.set_num_threads(1)

QWEN64 = BackboneConfig(size="tiny", image_size=64)
PG64 = BackboneConfig(family="paligemma", size="tiny", image_size=64)
ONE_CAM = TenantSchema(proprio_dim=4, action_dim=2, instruction="open the top drawer",
                       cameras=(CameraSpec("front", 64, 80),))
STATE_ONLY = TenantSchema(proprio_dim=25, action_dim=4, instruction="push the cube to the goal region")


def obs(schema: TenantSchema, seed: int, n: int = 1, instruction: str = "") -> list[Observation]:
    rng = np.random.default_rng(seed)
    return [Observation(state=rng.normal(size=schema.proprio_dim).astype(np.float32),
                        images={c.name: rng.integers(0, 256, (c.height, c.width, 3), dtype=np.uint8)
                                for c in schema.cameras}, instruction=instruction) for _ in range(n)]


def mixed_features(cfg: BackboneConfig) -> list:
    """LIBERO-like (2 cams), CALVIN-like (200 + 84 px), one camera, no camera; instructions of all lengths."""
    out = []
    for i, schema in enumerate([LIBERO_LIKE, STATE_ONLY, CALVIN_LIKE, ONE_CAM, LIBERO_LIKE]):
        pre = TenantPreprocessor(schema, cfg)
        out += [pre(o) for o in obs(schema, i, 2, instruction="x" if i == 1 else "")]
    return out


def test_paligemma_prefix_layout_and_frozen(tiny_paligemma):
    bb = tiny_paligemma
    assert bb.hidden_size == 64 and bb.num_hidden_states == 3
    assert not any(p.requires_grad for p in bb.model.parameters()) and not bb.model.training
    feat = TenantPreprocessor(LIBERO_LIKE, PG64)(obs(LIBERO_LIKE, 0)[0])
    assert feat.prompt.startswith(IMAGE_TOKEN * 2 + "<bos>") and feat.prompt.endswith("\n")
    batch = bb.family.prepare([feat])
    img_id = bb.model.config.image_token_id
    per_image = (64 // 16) ** 2
    ids = batch["input_ids"][0]
    assert (ids[: 2 * per_image] == img_id).all() and (ids[2 * per_image:] != img_id).all()  # images first
    assert batch["pixel_values"].shape == (2, 3, 64, 64)
    assert -1.0 <= float(batch["pixel_values"].min()) and float(batch["pixel_values"].max()) <= 1.0
    # a second offline build is bit-identical (every worker builds its own copy)
    again = SharedBackbone(PG64)
    assert all(torch.equal(a, b) for a, b in zip(bb.model.state_dict().values(),
                                                  again.model.state_dict().values(), strict=True))


@pytest.mark.parametrize("which", ["qwen3vl", "paligemma"])
def test_grouped_prefix_equals_single_forwards(which, tiny_backbone, tiny_paligemma):
    bb, cfg = (tiny_backbone, QWEN64) if which == "qwen3vl" else (tiny_paligemma, PG64)
    feats = mixed_features(cfg)
    before = bb.forward_calls
    out = bb.encode_prefix(feats, layers=(-2, -1))
    assert bb.forward_calls == before + 1
    assert out.layers == (-2, -1) and out.tokens.shape[:2] == (len(feats), 2) and out.mask.dtype == torch.bool
    # left padding: a row's real tokens are a suffix; the pooled feature is the masked mean of layer -1
    for r in range(len(feats)):
        m = out.mask[r]
        assert bool(m[-1]) and not bool((m[:-1].int() - m[1:].int() > 0).any())
        torch.testing.assert_close(out.pooled[r], out.layer(-1)[r][m].mean(0), rtol=1e-5, atol=1e-6)
    for r, f in enumerate(feats):
        single = bb.encode_prefix([f], layers=(-1,))
        row = out[r].with_layers((-1,))
        assert row.tokens.shape == single.tokens.shape  # trimmed to its own length
        assert (row.tokens - single.tokens).abs().max().item() <= 1e-5
        assert (row.pooled - single.pooled).abs().max().item() <= 1e-5
    assert (out.pooled[0] - out.pooled[2]).abs().max().item() > 1e-3  # rows really differ


def test_backbone_features_select_cat_and_layers(tiny_backbone):
    feats = mixed_features(QWEN64)
    out = tiny_backbone.encode_prefix(feats, layers=(0, -1))  # 0 = embeddings, normalized to -3
    assert out.layers == (-3, -1)
    parts = [out[[0, 1]], out[[2, 3, 4]], out[[5]]]
    assert parts[1].tokens.shape[2] <= out.tokens.shape[2]
    back = BackboneFeatures.cat(parts)
    assert len(back) == 6 and back.tokens.shape[2] == max(p.tokens.shape[2] for p in parts)
    for r in range(6):
        a, b = back[r], out[r]
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.mask, b.mask) and torch.equal(a.pooled, b.pooled)
    assert out.with_layers(()).tokens is None
    with pytest.raises(ValueError, match="not computed"):
        out.with_layers((-2,))
    with pytest.raises(ValueError, match="out of range"):
        tiny_backbone.encode_prefix(feats[:1], layers=(-4,))
    pooled_only = BackboneFeatures.of(out.pooled)
    assert pooled_only.tokens is None and len(pooled_only[[1, 2]]) == 2


def test_paligemma_local_checkpoint_gives_the_same_features(tiny_paligemma, tmp_path):
    """A Hugging Face PaliGemma checkpoint (the full conditional-generation model, as published) loads."""
    from transformers import PaliGemmaForConditionalGeneration

    full = PaliGemmaForConditionalGeneration(tiny_paligemma.model.config)
    full.model.load_state_dict(tiny_paligemma.model.state_dict())
    full.save_pretrained(tmp_path)
    tiny_paligemma.processor.tokenizer.save_pretrained(tmp_path)
    tiny_paligemma.processor.image_processor.save_pretrained(tmp_path)
    cfg = BackboneConfig(family="paligemma", local_path=str(tmp_path), image_size=64)
    loaded = SharedBackbone(cfg)
    o = obs(CALVIN_LIKE, 5)[0]
    got = loaded.encode_prefix([TenantPreprocessor(CALVIN_LIKE, cfg)(o)], layers=(-2, -1))
    want = tiny_paligemma.encode_prefix([TenantPreprocessor(CALVIN_LIKE, PG64)(o)], layers=(-2, -1))
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.pooled, want.pooled)


def test_config_validation():
    with pytest.raises(ValueError, match="unknown backbone family"):
        BackboneConfig(family="llava")
    with pytest.raises(ValueError, match="unknown dtype"):
        BackboneConfig(dtype="float8")
    # what needs the family's code is checked where a backbone or a preprocessor is built from the config
    with pytest.raises(ValueError, match="multiple of 16"):
        check(BackboneConfig(family="paligemma", size="tiny", image_size=72))
    with pytest.raises(ValueError, match="multiple of 32"):
        SharedBackbone(BackboneConfig(size="tiny", image_size=48))
    with pytest.raises(ValueError, match="paligemma backbone size"):
        TenantPreprocessor(ONE_CAM, BackboneConfig(family="paligemma", size="huge"))
    assert check(BackboneConfig(family="paligemma", image_size=48)).compat_key() == "paligemma:tiny:float32@48px"
    # the service's [backbone] settings are this one type
    assert ServiceConfig(root=".", backbone={"family": "paligemma", "image_size": 48}).backbone == \
        BackboneConfig(family="paligemma", image_size=48)


# -- the compatibility rule ------------------------------------------------------------------------


def test_compatibility_rule_truth_table():
    base = QWEN64.compat_key()
    merge = [BackboneConfig(size="tiny", image_size=64, device="cpu")]
    apart = [BackboneConfig(size="tiny", image_size=96),  # processor setting
             BackboneConfig(size="small", image_size=64),  # other weights
             BackboneConfig(size="tiny", image_size=64, dtype="bfloat16"),  # other numerics
             BackboneConfig(family="paligemma", size="tiny", image_size=64),  # other family
             BackboneConfig(local_path="/ckpt/qwen3-vl-4b", image_size=64)]  # a real checkpoint
    assert all(compatible(base, c.compat_key()) for c in merge)
    assert not any(compatible(base, c.compat_key()) for c in apart)
    assert len({c.compat_key() for c in apart}) == len(apart)


def _policy(name: str, family: str, schema: TenantSchema, seed: int) -> TenantPolicy:
    spec = TenantSpec(name=name, env="maniskill/pushcube-state", action_head=family, hidden_dim=32, seed=seed)
    return TenantPolicy.from_spec(spec, schema, 64)


def test_mergeable_requests_share_one_forward(tiny_backbone):
    """Different tenants, cameras, instructions, proprio/action dims and head families: one forward."""
    fw = VLAFramework(tiny_backbone)
    tenants = {"lib-oft": ("oft", LIBERO_LIKE), "cal-groot": ("groot", CALVIN_LIKE),
               "cam-pi": ("pi", ONE_CAM), "state-oft": ("oft", STATE_ONLY)}
    for i, (name, (family, schema)) in enumerate(tenants.items()):
        fw.add_tenant(name, _policy(name, family, schema, i), TenantPreprocessor(schema, QWEN64))
    reqs = [(name, fw.preprocess(name, o)) for i, (name, (_, schema)) in enumerate(tenants.items())
            for o in obs(schema, 10 + i, 2)]
    before = tiny_backbone.forward_calls
    out = fw.group_features(reqs)
    assert tiny_backbone.forward_calls == before + 1
    assert out["lib-oft"][1].tokens is None  # OFT reads pooled features only
    assert out["cal-groot"][1].layers == (-1,) and out["cam-pi"][1].layers == (-2, -1)
    for name, (idx, _) in out.items():
        assert [reqs[i][0] for i in idx] == [name] * 2


def test_non_mergeable_requests_run_apart_in_the_same_step(tiny_backbone, tiny_paligemma):
    """Another image size of the same model, and another backbone family: separate forwards, one call."""
    fw = VLAFramework(tiny_backbone, tiny_paligemma)
    cfg96 = BackboneConfig(size="tiny", image_size=96)
    setup = {"q64": (QWEN64, "oft", LIBERO_LIKE), "q96": (cfg96, "groot", ONE_CAM),
             "pg-lib": (PG64, "pi", LIBERO_LIKE), "pg-cal": (PG64, "pi", CALVIN_LIKE)}
    for i, (name, (cfg, family, schema)) in enumerate(setup.items()):
        fw.add_tenant(name, _policy(name, family, schema, i), TenantPreprocessor(schema, cfg))
    reqs = [(name, fw.preprocess(name, o)) for i, (name, (_, _, schema)) in enumerate(setup.items())
            for o in obs(schema, 20 + i, 2)]
    reqs = reqs[::2] + reqs[1::2]  # interleaved arrival
    q_before, p_before = tiny_backbone.forward_calls, tiny_paligemma.forward_calls
    grouped = fw.group_features(reqs)
    assert tiny_backbone.forward_calls == q_before + 2  # 64 px and 96 px: two forwards of the Qwen model
    assert tiny_paligemma.forward_calls == p_before + 1  # both π tenants: one PaliGemma forward
    for name, (idx, f) in grouped.items():
        alone = fw.group_features([reqs[i] for i in idx])[name][1]
        torch.testing.assert_close(f.pooled, alone.pooled, rtol=1e-5, atol=1e-5)
        if f.tokens is not None:
            torch.testing.assert_close(f.tokens, alone.tokens, rtol=1e-5, atol=1e-5)
    # actions for the whole mixed group come back in request order
    raw = [(name, o) for i, (name, (_, _, schema)) in enumerate(setup.items()) for o in obs(schema, 30 + i)]
    acts = fw.group_act(raw, deterministic=True)
    assert [a["action"].shape for a in acts] == [(s[2].action_dim,) for s in setup.values()]
    with pytest.raises(ValueError, match="targets"):  # no resident backbone for this model
        fw.add_tenant("small", _policy("small", "oft", ONE_CAM, 0),
                      TenantPreprocessor(ONE_CAM, BackboneConfig(size="small")))


def test_synthetic_schemas_are_faithful():
    for schema, cams in ((LIBERO_LIKE, {"agentview": (128, 128, 3), "wrist": (128, 128, 3)}),
                         (CALVIN_LIKE, {"rgb_static": (200, 200, 3), "rgb_gripper": (84, 84, 3)})):
        data = SyntheticTenant(schema, chunk=3)
        o, a = data.batch(4, seed=1)
        assert {k: v.shape for k, v in o[0].images.items()} == cams
        assert all(img.dtype == np.uint8 for img in o[0].images.values())
        assert o[0].state.shape == (schema.proprio_dim,) and a.shape == (4, 3 * 7) and np.abs(a).max() <= 1.0
        o2, a2 = data.batch(4, seed=1)
        first = next(iter(cams))
        assert np.array_equal(a, a2) and np.array_equal(o[0].images[first], o2[0].images[first])
