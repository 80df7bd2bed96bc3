"""Data types that cross process boundaries: raw observations and the backbone-facing VLAFeature.

numpy only (no torch): these objects travel through Dask between simulator, inference and actor
workers. Environments and datasets produce :class:`Observation` (raw, model-agnostic); a tenant
preprocessor (model side, ``nexus.model.preprocessor``) turns it into a :class:`VLAFeature`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class CameraSpec:
    name: str
    height: int
    width: int


@dataclass(frozen=True)
class TenantSchema:
    """What a tenant's observations and actions look like (from its env or dataset)."""

    proprio_dim: int
    action_dim: int
    cameras: tuple[CameraSpec, ...] = ()
    instruction: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain values, as manifests and exported policies store it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TenantSchema:
        return cls(proprio_dim=d["proprio_dim"], action_dim=d["action_dim"],
                   cameras=tuple(CameraSpec(**c) for c in d.get("cameras", ())),
                   instruction=d.get("instruction", ""))


@dataclass
class Observation:
    """One raw observation as a simulator or a dataset gives it (model-agnostic)."""

    state: np.ndarray  # float32 [proprio_dim]
    images: dict[str, np.ndarray] = field(default_factory=dict)  # camera -> uint8 [H, W, 3]
    instruction: str = ""
    # real-time chunking (a robot's request, never a simulator's): the actions of the previous chunk the robot has
    # executed or will have by the time this chunk arrives, float32 [k, action_dim], k <= the policy's chunk; a
    # chunked head's answer starts with them (``nexus.engine.engine``: inpainted into a flow head's denoising)
    executed_prefix: np.ndarray | None = None


@dataclass
class VLAFeature:
    """The backbone's standard input for one sample, after the tenant preprocessor.

    ``compat_key`` names the model-facing prefix settings (backbone + processor settings); only
    features with equal keys may share one backbone forward (group batching).
    """

    prompt: str  # chat-formatted text with one image placeholder per image
    images: list[np.ndarray]  # uint8 [H, W, 3], already at the processor's size
    proprio: np.ndarray  # float32 [proprio_dim], goes to the tenant's own head
    compat_key: str
