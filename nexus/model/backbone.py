"""The shared, frozen vision-language backbone (Qwen3-VL family) and its grouped forward.

Every process that needs features (actor workers, inference workers) builds its own copy. Offline
(``local_path`` unset) the model is a small Qwen3-VL built from a config with random weights under a
fixed seed and a tokenizer trained in-process, so equal configs give bit-identical weights in every
process without a model hub. With ``local_path`` a real checkpoint is loaded from disk.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import Qwen3VLProcessor

from nexus.features import VLAFeature

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", VISION_START, VISION_END, IMAGE_PAD,
                   "<|video_pad|>"]
# Qwen3-VL: 16 px patches merged 2x2 -> image sides must be multiples of 32 to avoid resampling.
_IMAGE_FACTOR = 32
_INIT_SEED = 0  # fixed: every process building the same offline config gets the same weights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Offline presets. text: hidden, layers, heads, kv heads, mlp; vision: hidden, depth, heads, mlp, deepstack
_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(th=64, tl=2, tn=4, tkv=2, ti=128, vh=32, vd=1, vn=2, vi=64, deep=(0,)),
    "small": dict(th=256, tl=4, tn=4, tkv=2, ti=512, vh=128, vd=4, vn=4, vi=256, deep=(1, 2, 3)),
    "medium": dict(th=1024, tl=12, tn=16, tkv=8, ti=2816, vh=768, vd=8, vn=12, vi=3072, deep=(2, 5, 7)),
}

# Toy corpus for the offline tokenizer: robot instructions, so common words become single tokens.
_CORPUS = [
    "pick up the red block and place it in the bowl", "open the top drawer", "close the microwave door",
    "push the blue cube to the left", "put the spoon on the towel", "pick up the cube and lift it",
    "stack the green block on the yellow block", "turn on the stove", "insert the peg into the hole",
    "push the cube to the goal region", "pull the cube towards the robot", "move the arm to the target",
]


@dataclass(frozen=True)
class BackboneConfig:
    """Which backbone to build and the processor settings that shape its inputs."""

    family: str = "qwen3vl"
    size: str = "tiny"  # offline preset, ignored when local_path is set
    local_path: str | None = None  # a real checkpoint directory (model + processor)
    image_size: int = 64  # square side every camera image is resized to
    dtype: str = "float32"  # float32 on CPU (bf16 is 3-4x slower there), bfloat16 on GPU
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.family != "qwen3vl":
            raise ValueError(f"unknown backbone family {self.family!r} (supported: 'qwen3vl')")
        if self.local_path is None and self.size not in _SIZES:
            raise ValueError(f"unknown backbone size {self.size!r} (offline presets: {sorted(_SIZES)})")
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r} (one of {sorted(_DTYPES)})")
        if self.image_size < _IMAGE_FACTOR or self.image_size % _IMAGE_FACTOR:
            raise ValueError(f"image_size must be a positive multiple of {_IMAGE_FACTOR}, "
                             f"got {self.image_size}")

    def model_key(self) -> str:
        """Names the weights and numerics (not the input settings): one resident model per model key."""
        return f"{self.family}:{self.local_path or self.size}:{self.dtype}"

    def compat_key(self) -> str:
        """Requests with equal keys may share one backbone forward (same model and processor settings)."""
        return f"{self.model_key()}@{self.image_size}px"


def model_key_of(compat_key: str) -> str:
    """The model part of a compat key (everything before the processor settings)."""
    return compat_key.rsplit("@", 1)[0]


def format_prompt(instruction: str, n_images: int) -> str:
    """Chat text for one sample: one vision placeholder per image, then the instruction."""
    vision = f"{VISION_START}{IMAGE_PAD}{VISION_END}" * n_images
    return f"<|im_start|>user\n{vision}{instruction}<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------------------
# offline construction


def _build_offline_tokenizer(vocab_size: int = 512) -> Any:
    """Byte-level BPE trained in-process on a fixed corpus: deterministic, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=_SPECIAL_TOKENS[1:])


class OfflineQwen3VLProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor without a video processor (the stock one needs torchvision)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def _build_offline_processor(tokenizer: Any, image_processor: Any = None) -> Any:
    from transformers import Qwen2VLImageProcessorPil

    if image_processor is None:  # accept any image the preprocessor produced without resampling it
        image_processor = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                                                   min_pixels=_IMAGE_FACTOR**2, max_pixels=1024 * 1024)
    return OfflineQwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                   video_processor=None, chat_template=None)


def _mrope_section(head_dim: int) -> list[int]:
    """Split of the rotary half-dim into (t, h, w) sections, as Qwen3-VL-4B does ([24, 20, 20] for 128)."""
    half = head_dim // 2
    hw = half * 5 // 16
    return [half - 2 * hw, hw, hw]


def _build_offline_model(tokenizer: Any, size: str) -> torch.nn.Module:
    from transformers import Qwen3VLConfig, Qwen3VLModel

    s = _SIZES[size]
    tid = tokenizer.convert_tokens_to_ids
    head_dim = s["th"] // s["tn"]
    cfg = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=s["th"], intermediate_size=s["ti"],
                         num_hidden_layers=s["tl"], num_attention_heads=s["tn"],
                         num_key_value_heads=s["tkv"], head_dim=head_dim, max_position_embeddings=4096,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                              mrope_section=_mrope_section(head_dim), mrope_interleaved=True),
                         pad_token_id=tid("<|endoftext|>")),
        vision_config=dict(depth=s["vd"], hidden_size=s["vh"], intermediate_size=s["vi"], num_heads=s["vn"],
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           out_hidden_size=s["th"], num_position_embeddings=256,
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
    return _build_offline_processor(AutoTokenizer.from_pretrained(path),
                                    Qwen2VLImageProcessorPil.from_pretrained(path))


# ---------------------------------------------------------------------------------------------------


class SharedBackbone:
    """The frozen backbone one process keeps resident; turns groups of VLAFeatures into feature rows.

    ``encode`` holds a lock: the model is shared, and concurrent forwards on the same CPU cores only
    slow each other down. The model is never trained (eval mode, no grads).
    """

    def __init__(self, cfg: BackboneConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if cfg.local_path is not None:
            from transformers import Qwen3VLModel

            if not os.path.isdir(cfg.local_path):  # never fall through to a model-hub download
                raise FileNotFoundError(f"backbone local_path {cfg.local_path!r} is not a directory")

            model = Qwen3VLModel.from_pretrained(cfg.local_path, dtype=_DTYPES[cfg.dtype])
            self.processor = _load_local_processor(cfg.local_path)
        else:
            tokenizer = _build_offline_tokenizer()
            self.processor = _build_offline_processor(tokenizer)
            model = _build_offline_model(tokenizer, cfg.size)
        self.processor.tokenizer.padding_side = "left"  # grouped == single needs left padding
        self.model = model.to(dtype=_DTYPES[cfg.dtype], device=self.device).eval()
        self.model.requires_grad_(False)
        self._image_token_id = int(self.model.config.image_token_id)
        self._lock = threading.Lock()
        self.forward_calls = 0  # backbone forwards run (monitoring: group batching efficiency)
        self.samples_encoded = 0  # samples actually sent through the model (after deduplication)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.text_config.hidden_size)

    @property
    def compat_key(self) -> str:
        return self.cfg.compat_key()

    def accepts(self, compat_key: str) -> bool:
        """Whether features with this key can run on this model (any image size of the same model)."""
        return model_key_of(compat_key) == self.cfg.model_key()

    def encode(self, features: list[VLAFeature]) -> torch.Tensor:
        """One grouped forward for all features (equal compat keys) -> pooled features [N, hidden] fp32.

        Identical samples (same prompt and same image bytes) are computed once. Features are the masked
        mean of the last hidden state; left padding and explicit per-sample M-RoPE positions make each
        row independent of the rest of the group (equal to a single-sample forward up to float noise,
        ~1e-7 in fp32). Samples with and without images, and with different numbers of images, mix
        in one forward: the processor maps the flat image list onto the placeholders in order, and
        text-only rows simply get no vision tokens, so no sub-batching is needed.
        """
        if not features:
            return torch.zeros(0, self.hidden_size, device=self.device)
        keys = {f.compat_key for f in features}
        if len(keys) != 1:
            raise ValueError(f"one grouped forward needs equal compat keys, got {sorted(keys)}")
        key = keys.pop()
        if not self.accepts(key):
            raise ValueError(f"feature compat key {key!r} does not match this backbone ({self.compat_key!r})")
        for f in features:
            if f.prompt.count(IMAGE_PAD) != len(f.images):
                raise ValueError(f"prompt has {f.prompt.count(IMAGE_PAD)} image placeholders but the "
                                 f"feature carries {len(f.images)} images")

        unique: dict[tuple[Any, ...], int] = {}
        rows: list[int] = []
        todo: list[VLAFeature] = []
        for f in features:
            k = _sample_key(f)
            if k not in unique:
                unique[k] = len(todo)
                todo.append(f)
            rows.append(unique[k])

        batch = self._prepare(todo)  # tokenization + image patching: outside the lock
        with self._lock:
            pooled = self._forward(batch)
            self.forward_calls += 1
            self.samples_encoded += len(todo)
        return pooled[torch.as_tensor(rows)] if len(todo) < len(features) else pooled

    def _prepare(self, feats: list[VLAFeature]) -> dict[str, Any]:
        images = [Image.fromarray(np.ascontiguousarray(img)) for f in feats for img in f.images]
        return dict(self.processor(text=[f.prompt for f in feats], images=images or None,
                                   return_tensors="pt", padding=True))

    @torch.no_grad()
    def _forward(self, batch: dict[str, Any]) -> torch.Tensor:
        has_images = "pixel_values" in batch
        input_ids = batch["input_ids"].to(self.device)
        attn = batch["attention_mask"].to(self.device)
        mm_types = (input_ids == self._image_token_id).int()  # 0 text, 1 image (no video here)
        grid = batch["image_grid_thw"].to(self.device) if has_images else None
        # Positions computed here (per sample, padding skipped) rather than inside forward(): the model
        # would otherwise cache rope deltas on itself, and text-only groups would get padded positions.
        position_ids, _ = self.model.get_rope_index(input_ids, mm_token_type_ids=mm_types,
                                                    image_grid_thw=grid, attention_mask=attn)
        kwargs: dict[str, Any] = {}
        if has_images:
            kwargs.update(pixel_values=batch["pixel_values"].to(self.device, self.model.dtype),
                          image_grid_thw=grid)
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
                         mm_token_type_ids=mm_types, use_cache=False, **kwargs)
        hidden = out.last_hidden_state.float()
        mask = attn.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1)


def _sample_key(f: VLAFeature) -> tuple[Any, ...]:
    """Identity of a sample's backbone input (prompt + image content) for deduplication."""
    digests = tuple(hashlib.blake2b(np.ascontiguousarray(img).tobytes(), digest_size=16,
                                    person=str(img.shape).encode()[:16]).digest() for img in f.images)
    return (f.prompt, digests)
