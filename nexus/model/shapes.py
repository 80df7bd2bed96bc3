"""Parameters, bytes and forward FLOPs of an offline backbone preset, counted on torch's meta device.

Where only shapes matter (how big is a Qwen3-VL-4B-shaped backbone, how many tenants fit beside it) the model is
built under ``torch.device("meta")``: every parameter has its real shape and no storage, so a 4 B-parameter
preset is counted in about a second and a few MiB. FLOPs are counted from the same modules: each ``nn.Linear``
and patch convolution costs 2 x its weight's elements per token it runs on, each attention layer 4 x T^2 x its
width (scores and the weighted sum, dense as SDPA runs them); norms, activations and rotary embeddings are left
out (under 1 % at these shapes).
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["BackboneCount", "count_backbone", "meta_model", "prefix_tokens"]

# top-level submodules of each family's model: the vision side (tower + projector) and the text decoder
_VISION = ("visual.", "vision_tower.", "multi_modal_projector.")
_TEXT = ("language_model.",)


def meta_model(family: str, size: str) -> nn.Module:
    """The offline preset ``family``/``size`` on the meta device: real shapes, no memory, no weights."""
    module = importlib.import_module(f"nexus.model.{family}")
    if size not in module.SIZES:
        raise ValueError(f"unknown {family} preset {size!r} (one of {sorted(module.SIZES)})")
    with torch.device("meta"):
        return module.build_offline_model(size)


def prefix_tokens(family: str, size: str, n_images: int, image_size: int, text_tokens: int) -> dict[str, int]:
    """Tokens of one sample's prefix: patches per image in the vision tower, image tokens in the text decoder."""
    module = importlib.import_module(f"nexus.model.{family}")
    s = module.SIZES[size]
    patch = s.get("patch", 16)
    if image_size % patch:
        raise ValueError(f"image_size {image_size} is not a multiple of the {patch} px patch")
    patches = (image_size // patch) ** 2
    merged = patches // 4 if family == "qwen3vl" else patches  # Qwen3-VL merges 2x2 patches into one token
    # the prompt's own tokens around the images: Qwen's vision start/end per image and the chat frame (5)
    frame = 2 * n_images + 5 if family == "qwen3vl" else 2
    return {"patches_per_image": patches, "image_tokens": n_images * merged, "text": text_tokens + frame,
            "decoder": n_images * merged + text_tokens + frame}


@dataclass(frozen=True)
class BackboneCount:
    family: str
    size: str
    params_vision: int
    params_text: int
    params_embedding: int  # of params_text: the token embedding (vocabulary x hidden)
    hidden: int
    layers: int
    flops_vision: int  # one sample's prefix (see count_backbone's arguments)
    flops_text: int

    @property
    def params(self) -> int:
        return self.params_vision + self.params_text

    def bytes(self, dtype: torch.dtype) -> int:
        return self.params * torch.finfo(dtype).bits // 8

    @property
    def flops(self) -> int:
        return self.flops_vision + self.flops_text

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "params": self.params, "bytes_bf16": self.bytes(torch.bfloat16),
                "bytes_fp32": self.bytes(torch.float32), "flops": self.flops}


def _weight_flops(module: nn.Module) -> int:
    """2 x weight elements: one output token (Linear) or one output patch (the patch convolutions)."""
    if isinstance(module, (nn.Linear, nn.Conv2d, nn.Conv3d)):
        return 2 * module.weight.numel()
    return 0


def count_backbone(family: str, size: str, n_images: int = 2, image_size: int = 224,
                   text_tokens: int = 16, model: nn.Module | None = None) -> BackboneCount:
    """Parameters of the preset and the FLOPs of one forward of one sample's prefix (``n_images`` square
    cameras of ``image_size`` px, an instruction of ``text_tokens`` tokens), from its meta-device build."""
    model = model if model is not None else meta_model(family, size)
    tokens = prefix_tokens(family, size, n_images, image_size, text_tokens)
    patches, decoder = tokens["patches_per_image"], tokens["decoder"]
    params = {"vision": 0, "text": 0}
    for name, p in model.named_parameters():
        side = "vision" if name.startswith(_VISION) else "text" if name.startswith(_TEXT) else None
        if side is None:
            raise ValueError(f"{family}/{size}: parameter {name!r} is neither the vision side nor the decoder")
        params[side] += p.numel()
    text_cfg, vision_cfg = model.config.text_config, model.config.vision_config
    embedding = model.get_input_embeddings().weight.numel()
    flops_v = flops_t = 0
    for name, m in model.named_modules():
        f = _weight_flops(m)
        if not f:
            continue
        if name.startswith(_TEXT):
            flops_t += f * decoder
        elif "merger" in name:  # Qwen3-VL's mergers run on merged tokens (4 patches each)
            flops_v += f * n_images * (patches // 4)
        else:
            flops_v += f * n_images * patches
    depth = getattr(vision_cfg, "depth", None) or vision_cfg.num_hidden_layers
    flops_v += depth * 4 * patches**2 * vision_cfg.hidden_size * n_images  # attention within each image
    width = text_cfg.num_attention_heads * text_cfg.head_dim
    flops_t += text_cfg.num_hidden_layers * 4 * decoder**2 * width
    return BackboneCount(family, size, params["vision"], params["text"], embedding, int(text_cfg.hidden_size),
                         int(text_cfg.num_hidden_layers), flops_v, flops_t)
