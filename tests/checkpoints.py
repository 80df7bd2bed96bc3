"""Checkpoints the tests write themselves (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path


def save_hf_checkpoint(backbone, path: Path) -> Path:
    """A backbone as a Hugging Face checkpoint dir, laid out like a hub Qwen3-VL model (conditional-generation
    weights + tokenizer + image processor)."""
    from transformers import Qwen3VLForConditionalGeneration

    full = Qwen3VLForConditionalGeneration(backbone.model.config)
    full.model.load_state_dict(backbone.model.state_dict())
    full.save_pretrained(path)
    backbone.processor.tokenizer.save_pretrained(path)
    backbone.processor.image_processor.save_pretrained(path)
    return path
