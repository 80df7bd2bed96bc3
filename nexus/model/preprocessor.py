"""Tenant preprocessor: one tenant's raw observation schema -> the backbone's standard VLAFeature."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from PIL import Image

from nexus.features import Observation, TenantSchema, VLAFeature
from nexus.model.backbone import BackboneConfig, check, family


class TenantPreprocessor:
    """Validates an observation against the tenant's schema and standardizes it.

    Cameras are taken in the schema's order (so the prompt's image placeholders always mean the same
    cameras) and resized to the backbone's square image size; the prompt follows the backbone
    family's prefix format; the proprio vector passes through as float32 for the tenant's own head.
    """

    def __init__(self, schema: TenantSchema, backbone_cfg: BackboneConfig) -> None:
        self.schema = schema
        self.image_size = check(backbone_cfg).image_size
        self.compat_key = backbone_cfg.compat_key()
        self._format_prompt = family(backbone_cfg.family).format_prompt
        self._camera_names = [c.name for c in schema.cameras]

    def __call__(self, obs: Observation) -> VLAFeature:
        state = np.asarray(obs.state, dtype=np.float32).reshape(-1)
        if state.shape[0] != self.schema.proprio_dim:
            raise ValueError(f"observation state has {state.shape[0]} dims, the tenant schema expects "
                             f"proprio_dim={self.schema.proprio_dim}")
        if not np.isfinite(state).all():
            raise ValueError("observation state contains NaN or inf")
        if set(obs.images) != set(self._camera_names):
            raise ValueError(f"observation cameras {sorted(obs.images)} do not match the tenant schema's "
                             f"cameras {sorted(self._camera_names)}")
        images = [self._image(c.name, c.height, c.width, obs.images[c.name]) for c in self.schema.cameras]
        instruction = obs.instruction or self.schema.instruction
        return VLAFeature(prompt=self._format_prompt(instruction, len(images)), images=images, proprio=state,
                          compat_key=self.compat_key)

    def batch(self, observations: Iterable[Observation]) -> list[VLAFeature]:
        return [self(o) for o in observations]

    def _image(self, name: str, height: int, width: int, img: np.ndarray) -> np.ndarray:
        img = np.asarray(img)
        if img.shape != (height, width, 3):
            raise ValueError(f"camera {name!r}: image shape {img.shape}, the tenant schema expects "
                             f"({height}, {width}, 3)")
        if img.dtype != np.uint8:
            raise ValueError(f"camera {name!r}: image dtype {img.dtype}, expected uint8 RGB")
        if (height, width) == (self.image_size, self.image_size):
            return np.ascontiguousarray(img)
        resized = Image.fromarray(img).resize((self.image_size, self.image_size), Image.Resampling.BILINEAR)
        return np.asarray(resized, dtype=np.uint8)
