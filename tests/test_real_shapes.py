"""Backbone presets of real shape (Qwen3-VL-2B / 4B, PaliGemma-3B) and their counts on the meta device.

The counts are checked against what can be worked out by hand from the published configurations (the decoder's
parameters layer by layer, the LoRA adapter's r x (in + out) per projection, the decoder's FLOPs per token), and
building the 4 B preset on the meta device must allocate nothing (fp32 it would be 16.5 GiB).
"""

from __future__ import annotations

import psutil
import pytest
import torch

from nexus.model.backbone import BackboneConfig, check
from nexus.model.lora import lora_shapes
from nexus.model.shapes import count_backbone, meta_model, prefix_tokens
from nexus.spec import LoraConfig

# published shapes (see the presets' comments): hidden, layers, heads, kv heads, head dim, mlp, vocabulary
QWEN_2B = dict(h=2048, L=28, nh=16, kv=8, hd=128, i=6144, V=151936)
QWEN_4B = dict(h=2560, L=36, nh=32, kv=8, hd=128, i=9728, V=151936)
PALI_3B = dict(h=2048, L=18, nh=8, kv=1, hd=256, i=16384, V=257216)


def decoder_params(h: int, L: int, nh: int, kv: int, hd: int, i: int, V: int, qk_norm: bool) -> int:
    """Embedding + per layer (q, k, v, o projections, gated MLP, two RMSNorms, Qwen3's q/k norms) + final norm."""
    attn = h * nh * hd + 2 * h * kv * hd + nh * hd * h
    layer = attn + 3 * h * i + 2 * h + (2 * hd if qk_norm else 0)
    return V * h + L * layer + h


def decoder_linear_flops_per_token(h: int, L: int, nh: int, kv: int, hd: int, i: int, **_) -> int:
    return 2 * L * (h * nh * hd + 2 * h * kv * hd + nh * hd * h + 3 * h * i)


@pytest.fixture(scope="module")
def qwen2b():
    return meta_model("qwen3vl", "2b")


def test_the_2b_preset_has_the_published_decoder_counted_by_hand(qwen2b):
    c = count_backbone("qwen3vl", "2b", model=qwen2b, n_images=2, image_size=224, text_tokens=16)
    assert c.params_text == decoder_params(**QWEN_2B, qk_norm=True) == 1_720_574_976
    assert c.params_embedding == QWEN_2B["V"] * QWEN_2B["h"] and (c.hidden, c.layers) == (2048, 28)
    assert c.bytes(torch.bfloat16) == 2 * c.params and c.bytes(torch.float32) == 4 * c.params
    # FLOPs of the decoder: its projections per prefix token, plus attention's 4 T^2 x width per layer
    t = prefix_tokens("qwen3vl", "2b", 2, 224, 16)
    assert t["patches_per_image"] == 14 * 14 and t["image_tokens"] == 2 * 49  # 16 px patches, merged 2x2
    T = t["decoder"]
    want = decoder_linear_flops_per_token(**QWEN_2B) * T + QWEN_2B["L"] * 4 * T * T * QWEN_2B["nh"] * QWEN_2B["hd"]
    assert c.flops_text == want
    # the vision side: 24 blocks of width 1024 over 196 patches per camera dominate it
    vision_blocks = 24 * (4 * 1024 * 1024 + 2 * 1024 * 4096)  # qkv + proj, fc1 + fc2
    assert c.flops_vision > 2 * 196 * 2 * vision_blocks


def test_lora_r8_is_r_times_in_plus_out_per_adapted_projection(qwen2b):
    shapes = lora_shapes(qwen2b, LoraConfig(rank=8))  # q_proj and v_proj of every decoder layer
    assert len(shapes) == 2 * 28
    q, v = 2048 + 16 * 128, 2048 + 8 * 128  # in + out of q_proj, of v_proj
    assert sum(8 * (i + o) for i, o in shapes.values()) == 28 * 8 * (q + v) == 1_605_632


@pytest.mark.parametrize(("family", "size", "shape", "qk_norm"), [
    ("qwen3vl", "4b", QWEN_4B, True), ("paligemma", "3b", PALI_3B, False)])
def test_big_presets_are_built_on_the_meta_device_without_memory(family, size, shape, qk_norm):
    rss = psutil.Process().memory_info().rss
    model = meta_model(family, size)
    grown = psutil.Process().memory_info().rss - rss
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    n = sum(p.numel() for p in params)
    assert n > 2.9e9 and grown < 512 * 2**20, f"{n / 1e9:.2f} B parameters took {grown / 2**20:.0f} MiB"
    text = sum(p.numel() for name, p in model.named_parameters() if name.startswith("language_model."))
    assert text == decoder_params(**shape, qk_norm=qk_norm)
    assert torch.get_default_device().type == "cpu"  # the meta context did not leak


def test_presets_are_backbone_sizes_with_their_image_rules():
    assert BackboneConfig(family="qwen3vl", size="2b").model_key() == "qwen3vl:2b:float32"
    assert BackboneConfig(family="qwen3vl", size="4b", image_size=224, dtype="bfloat16").image_size == 224
    assert BackboneConfig(family="paligemma", size="3b", image_size=224).compat_key().endswith("@224px")
    with pytest.raises(ValueError, match="multiple of 14"):  # SigLIP So400m/14: the family's check
        check(BackboneConfig(family="paligemma", size="3b", image_size=64))
    assert check(BackboneConfig(family="paligemma", size="3b", image_size=224)).size == "3b"
    with pytest.raises(ValueError, match="unknown qwen3vl preset"):
        meta_model("qwen3vl", "70b")
