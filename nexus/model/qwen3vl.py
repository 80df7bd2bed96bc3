"""The Qwen3-VL backbone family (StarVLA's Qwen-GR00T / Qwen-OFT backbones), offline or from a checkpoint.

Offline (``local_path`` unset) the model is a small Qwen3-VL built from a config with random weights
under a fixed seed and a byte-level BPE tokenizer trained in-process, so equal configs give
bit-identical weights in every process without a model hub. With ``local_path`` a real checkpoint
(model + tokenizer + image processor) is loaded from disk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image
from transformers import Qwen3VLProcessor

from nexus.features import VLAFeature

if TYPE_CHECKING:
    from nexus.model.backbone import BackboneConfig

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", VISION_START, VISION_END, IMAGE_PAD,
                   "<|video_pad|>"]
# 16 px patches merged 2x2 -> image sides must be multiples of 32 to avoid resampling.
IMAGE_FACTOR = 32

# Offline presets. text: hidden, layers, heads, kv heads, mlp (head dim: hidden / heads unless `hd`; vocabulary:
# the offline tokenizer's unless `vocab`); vision: hidden, depth, heads, mlp, deepstack (`pos`: its position table)
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(th=64, tl=2, tn=4, tkv=2, ti=128, vh=32, vd=1, vn=2, vi=64, deep=(0,)),
    "small": dict(th=256, tl=4, tn=4, tkv=2, ti=512, vh=128, vd=4, vn=4, vi=256, deep=(1, 2, 3)),
    "medium": dict(th=1024, tl=12, tn=16, tkv=8, ti=2816, vh=768, vd=8, vn=12, vi=3072, deep=(2, 5, 7)),
    # The architectures of the released models, random weights (never downloaded): the `config.json` of
    # Qwen/Qwen3-VL-2B-Instruct and Qwen/Qwen3-VL-4B-Instruct (text_config / vision_config; rope theta 5e6,
    # mrope [24, 20, 20], vision patch 16, merge 2, 2304 position embeddings, deepstack layers 5, 11, 17).
    # The text towers are Qwen3-1.7B's and Qwen3-4B's shapes. Built for real they take 8 / 18 GB in fp32:
    # count them on the meta device (nexus.model.shapes).
    "2b": dict(th=2048, tl=28, tn=16, tkv=8, hd=128, ti=6144, vocab=151936, theta=5e6,
               vh=1024, vd=24, vn=16, vi=4096, deep=(5, 11, 17), pos=2304),
    "4b": dict(th=2560, tl=36, tn=32, tkv=8, hd=128, ti=9728, vocab=151936, theta=5e6,
               vh=1024, vd=24, vn=16, vi=4096, deep=(5, 11, 17), pos=2304),
}

# Toy corpus for the offline tokenizer: robot instructions, so common words become single tokens.
CORPUS = [
    "pick up the red block and place it in the bowl", "open the top drawer", "close the microwave door",
    "push the blue cube to the left", "put the spoon on the towel", "pick up the cube and lift it",
    "stack the green block on the yellow block", "turn on the stove", "insert the peg into the hole",
    "push the cube to the goal region", "pull the cube towards the robot", "move the arm to the target",
]
_INIT_SEED = 0  # fixed: every process building the same offline config gets the same weights


def format_prompt(instruction: str, n_images: int) -> str:
    """Chat text for one sample: one vision placeholder per image, then the instruction."""
    vision = f"{VISION_START}{IMAGE_PAD}{VISION_END}" * n_images
    return f"<|im_start|>user\n{vision}{instruction}<|im_end|>\n<|im_start|>assistant\n"


def build_bpe_tokenizer(special_tokens: list[str], eos: str, pad: str, bos: str | None = None,
                        vocab_size: int = 512) -> Any:
    """Byte-level BPE trained in-process on a fixed corpus: deterministic, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    extra = [t for t in special_tokens if t not in (eos, pad, bos)]
    kwargs = {"bos_token": bos} if bos else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad,
                                   additional_special_tokens=extra, **kwargs)


class OfflineQwen3VLProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor without a video processor (the stock one needs torchvision)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def _build_processor(tokenizer: Any, image_processor: Any = None) -> Any:
    from transformers import Qwen2VLImageProcessorPil

    if image_processor is None:  # accept any image the preprocessor produced without resampling it
        image_processor = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                                                   min_pixels=IMAGE_FACTOR**2, max_pixels=1024 * 1024)
    return OfflineQwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                   video_processor=None, chat_template=None)


def _mrope_section(head_dim: int) -> list[int]:
    """Split of the rotary half-dim into (t, h, w) sections, as Qwen3-VL-4B does ([24, 20, 20] for 128)."""
    half = head_dim // 2
    hw = half * 5 // 16
    return [half - 2 * hw, hw, hw]


def _build_offline_model(tokenizer: Any, size: str) -> torch.nn.Module:
    from transformers import Qwen3VLConfig, Qwen3VLModel

    s = SIZES[size]
    tid = tokenizer.convert_tokens_to_ids
    head_dim = s.get("hd", s["th"] // s["tn"])
    cfg = Qwen3VLConfig(
        text_config=dict(vocab_size=s.get("vocab", len(tokenizer)), hidden_size=s["th"], intermediate_size=s["ti"],
                         num_hidden_layers=s["tl"], num_attention_heads=s["tn"],
                         num_key_value_heads=s["tkv"], head_dim=head_dim, max_position_embeddings=4096,
                         rope_parameters=dict(rope_type="default", rope_theta=s.get("theta", 10000.0),
                                              mrope_section=_mrope_section(head_dim), mrope_interleaved=True),
                         pad_token_id=tid("<|endoftext|>")),
        vision_config=dict(depth=s["vd"], hidden_size=s["vh"], intermediate_size=s["vi"], num_heads=s["vn"],
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           out_hidden_size=s["th"], num_position_embeddings=s.get("pos", 256),
                           deepstack_visual_indexes=list(s["deep"])),
        image_token_id=tid(IMAGE_PAD), video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid(VISION_START), vision_end_token_id=tid(VISION_END),
    )
    cfg._attn_implementation = "sdpa"
    # Seeded init on CPU in float32, in a forked RNG so the caller's random stream is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_INIT_SEED)
        return Qwen3VLModel(cfg)


def _load_local_processor(path: str) -> Any:
    from transformers import AutoProcessor, AutoTokenizer, Qwen2VLImageProcessorPil

    try:
        processor = AutoProcessor.from_pretrained(path)
        if hasattr(processor, "image_processor") and hasattr(processor, "tokenizer"):
            return processor
    except (ImportError, ValueError, TypeError, OSError):
        pass  # the stock Qwen3-VL processor needs a video processor (torchvision)
    # Images only need the tokenizer + the PIL image processor saved in the checkpoint directory.
    return _build_processor(AutoTokenizer.from_pretrained(path), Qwen2VLImageProcessorPil.from_pretrained(path))


def offline_tokenizer() -> Any:
    return build_bpe_tokenizer(_SPECIAL_TOKENS, eos="<|im_end|>", pad="<|endoftext|>")


def build_offline_model(size: str) -> torch.nn.Module:
    """An offline preset's model (on the current default device: ``with torch.device("meta")`` for shapes only)."""
    return _build_offline_model(offline_tokenizer(), size)


class Qwen3VLFamily:
    """Model + processor of one Qwen3-VL backbone, and how a group of VLAFeatures runs through it."""

    name = "qwen3vl"
    image_placeholder = IMAGE_PAD
    sizes = SIZES

    @staticmethod
    def image_factor(size: str | None = None) -> int:
        return IMAGE_FACTOR

    format_prompt = staticmethod(format_prompt)

    def __init__(self, cfg: BackboneConfig, dtype: torch.dtype) -> None:
        if cfg.local_path is not None:
            from transformers import Qwen3VLModel

            self.model = Qwen3VLModel.from_pretrained(cfg.local_path, dtype=dtype)
            self.processor = _load_local_processor(cfg.local_path)
        else:
            tokenizer = offline_tokenizer()
            self.processor = _build_processor(tokenizer)
            self.model = _build_offline_model(tokenizer, cfg.size)
        self.processor.tokenizer.padding_side = "left"  # grouped == single needs left padding
        self._image_token_id = int(self.model.config.image_token_id)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.text_config.hidden_size)

    @property
    def num_hidden_states(self) -> int:
        """Embeddings + one per decoder layer."""
        return int(self.model.config.text_config.num_hidden_layers) + 1

    def prepare(self, feats: list[VLAFeature]) -> dict[str, Any]:
        """Tokenization + image patching (CPU, outside the model lock)."""
        images = [Image.fromarray(np.ascontiguousarray(img)) for f in feats for img in f.images]
        return dict(self.processor(text=[f.prompt for f in feats], images=images or None,
                                   return_tensors="pt", padding=True))

    def forward(self, batch: dict[str, Any], device: torch.device,
                hidden_states: bool) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """-> (all hidden states, or just the last one; attention mask [N, T])."""
        model = self.model
        has_images = "pixel_values" in batch
        input_ids = batch["input_ids"].to(device)
        attn = batch["attention_mask"].to(device)
        mm_types = (input_ids == self._image_token_id).int()  # 0 text, 1 image (no video here)
        grid = batch["image_grid_thw"].to(device) if has_images else None
        # Positions computed here (per sample, padding skipped) rather than inside forward(): the model
        # would otherwise cache rope deltas on itself, and text-only groups would get padded positions.
        position_ids, _ = model.get_rope_index(input_ids, mm_token_type_ids=mm_types, image_grid_thw=grid,
                                               attention_mask=attn)
        kwargs: dict[str, Any] = {}
        if has_images:
            kwargs.update(pixel_values=batch["pixel_values"].to(device, model.dtype), image_grid_thw=grid)
        out = model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
                    mm_token_type_ids=mm_types, use_cache=False, output_hidden_states=hidden_states, **kwargs)
        return (tuple(out.hidden_states) if hidden_states else (out.last_hidden_state,)), attn
