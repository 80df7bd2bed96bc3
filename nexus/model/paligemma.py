"""The PaliGemma backbone family (SigLIP + Gemma), the VLM that OpenPI's π0 / π0.5 build on.

The prefix is laid out as PaliGemma and OpenPI do: the image tokens of every camera (each image
through SigLIP separately, then concatenated), ``<bos>``, the instruction, ``\\n``. The prefix attends
bidirectionally (``token_type_ids`` all 0), as in π0's prefix. The real Gemma tokenizer is not shipped
offline, so offline presets use a byte-level BPE trained in-process with PaliGemma's special tokens;
``local_path`` loads a real Hugging Face PaliGemma checkpoint (model, tokenizer, image processor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nexus.features import VLAFeature
from nexus.model.qwen3vl import build_bpe_tokenizer

if TYPE_CHECKING:
    from nexus.model.backbone import BackboneConfig

IMAGE_TOKEN, BOS, EOS, PAD = "<image>", "<bos>", "<eos>", "<pad>"

# Offline presets. text (Gemma): hidden, layers, heads, kv heads, head dim, mlp;
# vision (SigLIP): hidden, layers, heads, mlp, patch, native image side
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(th=64, tl=2, tn=4, tkv=1, thd=16, ti=128, vh=32, vl=1, vn=2, vi=64, patch=16, img=64),
    "small": dict(th=256, tl=4, tn=4, tkv=1, thd=64, ti=512, vh=128, vl=4, vn=4, vi=512, patch=16, img=64),
    # ~SigLIP-B/16 + a 12-layer Gemma: the GPU preset of the group-batching experiment
    "medium": dict(th=1024, tl=12, tn=8, tkv=1, thd=128, ti=4096, vh=768, vl=12, vn=12, vi=3072, patch=16,
                   img=224),
    # google/paligemma-3b-pt-224's architecture, random weights (never downloaded): its config.json (Gemma-2B
    # text tower, 257216-token vocabulary; SigLIP So400m/14 at 224 px, projection to 2048). 11.7 GB in fp32:
    # count it on the meta device (nexus.model.shapes).
    "3b": dict(th=2048, tl=18, tn=8, tkv=1, thd=256, ti=16384, vocab=257216, vh=1152, vl=27, vn=16, vi=4304,
               patch=14, img=224),
}
_INIT_SEED = 0


def format_prompt(instruction: str, n_images: int) -> str:
    """PaliGemma prefix text: one ``<image>`` per camera (expanded to its patch tokens at tokenization)."""
    return f"{IMAGE_TOKEN * n_images}{BOS}{instruction}\n"


def _build_offline_model(tokenizer: Any, size: str) -> torch.nn.Module:
    from transformers import PaliGemmaConfig, PaliGemmaModel

    s = SIZES[size]
    cfg = PaliGemmaConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=s["vh"], intermediate_size=s["vi"],
                           num_hidden_layers=s["vl"], num_attention_heads=s["vn"], image_size=s["img"],
                           patch_size=s["patch"], projection_dim=s["th"]),
        text_config=dict(model_type="gemma", vocab_size=s.get("vocab", len(tokenizer)), hidden_size=s["th"],
                         intermediate_size=s["ti"], num_hidden_layers=s["tl"], num_attention_heads=s["tn"],
                         num_key_value_heads=s["tkv"], head_dim=s["thd"], pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), projection_dim=s["th"])
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_INIT_SEED)
        return PaliGemmaModel(cfg)


def offline_tokenizer() -> Any:
    return build_bpe_tokenizer([PAD, EOS, BOS, IMAGE_TOKEN], eos=EOS, pad=PAD, bos=BOS)


def build_offline_model(size: str) -> torch.nn.Module:
    """An offline preset's model (on the current default device: ``with torch.device("meta")`` for shapes only)."""
    return _build_offline_model(offline_tokenizer(), size)


class PaliGemmaInputs:
    """The processor side: tokenizer + SigLIP image processor (PaliGemmaProcessor refuses text-only rows)."""

    def __init__(self, tokenizer: Any, image_processor: Any) -> None:
        self.tokenizer, self.image_processor = tokenizer, image_processor


class PaliGemmaFamily:
    name = "paligemma"
    image_placeholder = IMAGE_TOKEN
    sizes = SIZES
    format_prompt = staticmethod(format_prompt)

    @staticmethod
    def image_factor(size: str | None = None) -> int:
        return SIZES[size]["patch"] if size in SIZES else 14  # real PaliGemma: 14 px patches

    def __init__(self, cfg: BackboneConfig, dtype: torch.dtype) -> None:
        from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

        if cfg.local_path is not None:
            from transformers import AutoTokenizer, PaliGemmaModel

            self.model = PaliGemmaModel.from_pretrained(cfg.local_path, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(cfg.local_path)
            image_processor = SiglipImageProcessorPil.from_pretrained(cfg.local_path)
        else:
            tokenizer = offline_tokenizer()
            self.model = _build_offline_model(tokenizer, cfg.size)
            image_processor = SiglipImageProcessorPil()  # mean = std = 0.5, as SigLIP was trained
        self.processor = PaliGemmaInputs(tokenizer, image_processor)
        vision = self.model.config.vision_config
        self.patch_size, self.native_image_size = int(vision.patch_size), int(vision.image_size)
        if cfg.image_size % self.patch_size:
            raise ValueError(f"image_size {cfg.image_size} is not a multiple of the SigLIP patch size "
                             f"{self.patch_size}")
        self._image_token_id = int(self.model.config.image_token_id)
        self._pad_id = int(tokenizer.pad_token_id)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.text_config.hidden_size)

    @property
    def num_hidden_states(self) -> int:
        return int(self.model.config.text_config.num_hidden_layers) + 1

    def prepare(self, feats: list[VLAFeature]) -> dict[str, Any]:
        """Token ids (each ``<image>`` expanded to the image's patch tokens), left padding, pixel values."""
        tok = self.processor.tokenizer
        images = [np.ascontiguousarray(img) for f in feats for img in f.images]
        sides = {img.shape[:2] for img in images}
        if len(sides) > 1 or any(h != w or h % self.patch_size for h, w in sides):
            raise ValueError(f"one PaliGemma forward needs square images of one size (a multiple of "
                             f"{self.patch_size} px), got {sorted(sides)}")
        side = next(iter(sides))[0] if sides else self.native_image_size
        per_image = (side // self.patch_size) ** 2
        seqs: list[list[int]] = []
        for f in feats:
            ids: list[int] = []
            for t in tok(f.prompt, add_special_tokens=False)["input_ids"]:
                ids.extend([t] * per_image if t == self._image_token_id else [t])
            seqs.append(ids)
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), width), self._pad_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            input_ids[i, width - len(s):] = torch.as_tensor(s)
            attn[i, width - len(s):] = 1
        batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attn}
        if images:
            # already at the backbone's size (tenant preprocessor): normalize only
            batch["pixel_values"] = self.processor.image_processor(
                images=images, do_resize=False, return_tensors="pt")["pixel_values"]
        return batch

    def forward(self, batch: dict[str, Any], device: torch.device,
                hidden_states: bool) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        model = self.model
        input_ids = batch["input_ids"].to(device)
        attn = batch["attention_mask"].to(device)
        # 1-indexed positions counted over real tokens only, so left padding never shifts a sample
        position_ids = attn.cumsum(1).clamp(min=1)
        mm: dict[str, Any] = {}
        if "pixel_values" in batch:
            pixels = batch["pixel_values"].to(device, model.dtype)
            # SigLIP's position table is for its native side; other sides interpolate it
            mm["image"] = model.get_image_features(
                pixels, interpolate_pos_encoding=pixels.shape[-1] != self.native_image_size)
        out = model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
                    token_type_ids=torch.zeros_like(input_ids), mm_encoder_outputs=mm or None, use_cache=False,
                    output_hidden_states=hidden_states)
        return (tuple(out.hidden_states) if hidden_states else (out.last_hidden_state,)), attn
