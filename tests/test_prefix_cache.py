"""The inference engine's prefix cache (``nexus.model.prefix_cache``): a state-only tenant's backbone features
are computed once per instruction and adapter, and every answer equals the uncached engine's — LoRA and
plain tenants, image and state-only ones, a pinned version beside the live one, after a weight sync."""

from __future__ import annotations

import gc
import io

import numpy as np
import pytest
import torch

from nexus.config.service import ServiceConfig
from nexus.engine.engine import InferenceEngine, _Request
from nexus.features import CameraSpec, Observation, TenantSchema
from nexus.model.backbone_features import BackboneFeatures
from nexus.model.framework import VLAFramework
from nexus.model.policy import TenantPolicy
from nexus.model.prefix_cache import PrefixCache
from nexus.spec import LoraConfig, TenantSpec

STATE = TenantSchema(proprio_dim=9, action_dim=4, instruction="push the cube to the goal")
CAMERA = TenantSchema(proprio_dim=5, action_dim=3, instruction="push the cube to the goal",
                      cameras=(CameraSpec("front", 48, 64),))
LORA = LoraConfig(rank=4, alpha=8)


def spec(name: str, seed: int, family: str = "oft", lora: LoraConfig | None = None) -> TenantSpec:
    return TenantSpec(name=name, env="maniskill/pushcube-state", seed=seed, hidden_dim=32, action_head=family,
                      lora=lora)


def weights(engine: InferenceEngine, s: TenantSpec, schema: TenantSchema, adapter_seed: int | None = None) -> bytes:
    """A policy's weights as the actor exports them; ``adapter_seed``: a trained-looking adapter (B != 0)."""
    bb = engine.heads.framework.backbone
    policy = TenantPolicy.from_spec(s, schema, bb.hidden_size, lora_shapes=bb.lora_shapes(s.lora))
    if adapter_seed is not None:
        g = torch.Generator().manual_seed(adapter_seed)
        with torch.no_grad():
            for p in policy.lora.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    buf = io.BytesIO()
    torch.save(policy.state_dict(), buf)
    return buf.getvalue()


def make_engine(tiny_backbone, tmp_path, **caches) -> InferenceEngine:
    engine = InferenceEngine(ServiceConfig(root=str(tmp_path), caches=caches))
    engine.heads.framework = VLAFramework(tiny_backbone)
    return engine


def register(engine: InferenceEngine, s: TenantSpec, schema: TenantSchema, version: int = 0,
             adapter_seed: int | None = None) -> None:
    engine.heads.register(s, schema, version, weights(engine, s, schema, adapter_seed))


def obs(schema: TenantSchema, seed: int, instruction: str | None = None) -> Observation:
    rng = np.random.default_rng(seed)
    images = {c.name: rng.integers(0, 256, (c.height, c.width, 3), dtype=np.uint8) for c in schema.cameras}
    return Observation(state=rng.normal(size=schema.proprio_dim).astype(np.float32), images=images,
                       instruction=instruction)


def uncached(engine: InferenceEngine, group: list[_Request]) -> list[dict]:
    """The same rows through the same engine without its cache: what every answer must equal."""
    fw = engine.heads.framework
    cache, fw.prefix_cache = fw.prefix_cache, None
    try:
        return engine._forward(group)
    finally:
        fw.prefix_cache = cache


def assert_same(got: list[dict], want: list[dict]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(g["action"], w["action"], rtol=1e-5, atol=1e-5, err_msg=f"row {i}")
        assert g["logprob"] == pytest.approx(w["logprob"], rel=1e-5, abs=1e-5), i
        assert g["value"] == pytest.approx(w["value"], rel=1e-5, abs=1e-5), i
        assert g["version"] == w["version"]
        if "chunk" in w:
            np.testing.assert_allclose(g["chunk"], w["chunk"], rtol=1e-5, atol=1e-5)


def test_state_only_rows_skip_the_backbone_and_answer_as_before(tiny_backbone, tmp_path):
    engine = make_engine(tiny_backbone, tmp_path)
    for s, schema in ((spec("a", 1), STATE), (spec("b", 2), STATE), (spec("g", 3, "groot"), STATE),
                      (spec("cam", 4), CAMERA)):
        register(engine, s, schema)
    cache, bb = engine.heads.framework.prefix_cache, tiny_backbone
    assert cache is not None and len(cache) == 0

    def group(seed: int, cameras: bool = True) -> list[_Request]:
        rows = [_Request(t, obs(STATE, seed + i), None, det, None, seed=None if det else seed + i)
                for i, (t, det) in enumerate([("a", True), ("b", True), ("a", False), ("g", True), ("g", False),
                                              ("b", False)])]
        rows.append(_Request("a", obs(STATE, seed, "push it elsewhere"), None, True, None))  # its own prefix
        if cameras:
            rows += [_Request("cam", obs(CAMERA, seed + 10 + i), None, True, None) for i in range(2)]
        return rows

    first = group(0)
    assert_same(engine._forward(first), uncached(engine, first))  # computed (and kept) in the shared forward
    assert len(cache) == 2  # one entry per image-free prefix (all tenants of one instruction share it), none for images
    for seed in (100, 200):  # new states, same prefixes
        rows = group(seed)
        calls = bb.forward_calls
        got = engine._forward(rows)
        assert bb.forward_calls == calls + 1  # the camera rows only
        assert_same(got, uncached(engine, rows))
    hits = cache.hits
    calls = bb.forward_calls
    rows = group(300, cameras=False)
    got = engine._forward(rows)
    assert bb.forward_calls == calls and cache.hits > hits  # no backbone forward at all
    assert_same(got, uncached(engine, rows))
    assert len(cache) == 2
    assert engine.engine_stats()["prefix_cache"] == cache.stats() and cache.stats()["hits"] == cache.hits
    engine.reset_stats()
    assert engine.engine_stats()["prefix_cache"] == {**cache.stats(), "hits": 0, "misses": 0} and len(cache) == 2

    off = make_engine(tiny_backbone, tmp_path, prefix_cache_mb=0)
    assert off.heads.framework.prefix_cache is None


def test_a_lora_tenant_never_reads_features_of_another_adapter(tiny_backbone, tmp_path):
    engine = make_engine(tiny_backbone, tmp_path)
    lora, plain = spec("l", 5, lora=LORA), spec("p", 6)
    register(engine, lora, STATE, 0, adapter_seed=10)
    register(engine, plain, STATE)
    cache = engine.heads.framework.prefix_cache
    rows = [_Request("l", obs(STATE, i), None, True, None) for i in range(3)]
    rows += [_Request("p", obs(STATE, 10 + i), None, True, None) for i in range(2)]
    v0 = engine._forward(rows)
    assert_same(v0, uncached(engine, rows))
    assert len(cache) == 2  # the same prompt under the adapter and under the base model: two entries
    old = engine.heads.policy_of("l", None)

    # a weight sync: version 1's adapter differs; its rows must not get version 0's cached features
    engine.heads.load("l", 1, weights(engine, lora, STATE, adapter_seed=11))
    v1 = engine._forward(rows)
    assert_same(v1, uncached(engine, rows))
    assert max(np.abs(a["action"] - b["action"]).max() for a, b in zip(v0[:3], v1[:3], strict=True)) > 1e-4
    assert_same(v1[3:], v0[3:])  # the plain tenant is untouched

    # version 0 pinned by an evaluation beside the live version 1, in one group
    engine.heads.pinned[("l", 0)] = [old, 1]
    mixed = [_Request("l", obs(STATE, 20 + i), v, True, None) for i, v in enumerate([0, None, 0, 1])]
    got = engine._forward(mixed)
    assert_same(got, uncached(engine, mixed))
    assert [o["version"] for o in got] == [0, 1, 0, 1]
    assert len(cache) == 3

    # the same version number registered again (a deleted tenant created anew) with other weights
    engine.heads.unregister("l")
    register(engine, lora, STATE, 1, adapter_seed=12)
    again = engine._forward(rows[:3])
    assert_same(again, uncached(engine, rows[:3]))
    assert max(np.abs(a["action"] - b["action"]).max() for a, b in zip(v1[:3], again, strict=True)) > 1e-4

    del old, got  # nothing holds the unpinned adapters any more: their entries go
    gc.collect()
    engine._forward(rows[3:])
    assert len(cache) == 2  # the base model's prompt and the live adapter's


def row(prompt_len: int, layers: tuple[int, ...] = ()) -> BackboneFeatures:
    pooled = torch.randn(1, 8)
    if not layers:
        return BackboneFeatures(pooled)
    tokens, mask = torch.randn(1, len(layers), prompt_len, 8), torch.ones(1, prompt_len, dtype=torch.bool)
    return BackboneFeatures(pooled, tokens, mask, layers)


def test_prefix_cache_is_bounded_least_recently_used_first():
    one = 8 * 4  # bytes of one pooled row
    cache = PrefixCache(3 * one)
    keys = [cache.key("m@64px", f"prompt {i}", 0, None) for i in range(4)]
    assert cache.key("m@64px", "prompt 0", 1, None) is None  # samples with images are not cached
    rows = [row(0) for _ in keys]
    for k, r in zip(keys[:3], rows, strict=False):
        cache.put(k, r)
    assert torch.equal(cache.get(keys[0], ()).pooled, rows[0].pooled)  # 0 is now the most recent
    cache.put(keys[3], rows[3])
    assert cache.get(keys[1], ()) is None and cache.evictions == 1  # 1 was the least recently used
    assert cache.bytes == 3 * one and len(cache) == 3

    with_tokens = row(5, (-2, -1))
    cache.put(keys[1], with_tokens)  # larger than the whole cache: not kept, nothing evicted for it
    assert cache.get(keys[1], ()) is None and len(cache) == 3 and cache.evictions == 1
    big = PrefixCache(10_000)
    big.put(keys[0], with_tokens)
    got = big.get(keys[0], (-1,))
    assert got.layers == (-1,) and torch.equal(got.layer(-1), with_tokens.layer(-1))
    assert big.get(keys[0], (-3, -1)) is None  # a layer it was not computed with: a miss
    with pytest.raises(ValueError):
        PrefixCache(0)
