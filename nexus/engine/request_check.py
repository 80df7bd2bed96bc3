"""A request's observation checked against its tenant's schema before it may join an inference group.

One malformed observation must fail only its own request, never the group it would have shared a
backbone forward with. numpy only; cheap enough to run on the worker's event loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nexus.errors import SpecError
from nexus.features import Observation, TenantSchema


def check_request(obs: Any, schema: TenantSchema, tenant: str = "") -> None:
    """Raise ``SpecError`` (saying what is wrong) unless ``obs`` fits ``schema``."""
    who = f"tenant {tenant!r}: " if tenant else ""
    if not isinstance(obs, Observation):
        raise SpecError(f"{who}an action request needs a nexus.features.Observation, got {type(obs).__name__}")
    try:
        state = np.asarray(obs.state)
    except Exception as e:
        raise SpecError(f"{who}observation state is not an array: {e}") from None
    if state.dtype.kind not in "fiub":
        raise SpecError(f"{who}observation state has dtype {state.dtype}, expected numbers")
    if state.size != schema.proprio_dim or state.ndim > 1 and state.shape[0] != state.size:
        raise SpecError(f"{who}observation state has shape {state.shape}, the tenant schema expects "
                        f"({schema.proprio_dim},)")
    if not np.isfinite(state.astype(np.float64, copy=False)).all():
        raise SpecError(f"{who}observation state contains NaN or inf")
    images = obs.images if isinstance(obs.images, dict) else None
    if images is None:
        raise SpecError(f"{who}observation images must be a dict camera -> uint8 [H, W, 3]")
    expected = {c.name: c for c in schema.cameras}
    if set(images) != set(expected):
        raise SpecError(f"{who}observation cameras {sorted(images)} do not match the tenant schema's "
                        f"cameras {sorted(expected)}")
    for name, cam in expected.items():
        img = images[name]
        shape, dtype = getattr(img, "shape", None), getattr(img, "dtype", None)
        if shape != (cam.height, cam.width, 3):
            raise SpecError(f"{who}camera {name!r}: image shape {shape}, the tenant schema expects "
                            f"({cam.height}, {cam.width}, 3)")
        if dtype != np.uint8:
            raise SpecError(f"{who}camera {name!r}: image dtype {dtype}, expected uint8 RGB")
    if not isinstance(obs.instruction, str):
        raise SpecError(f"{who}observation instruction must be a string")
    prefix = getattr(obs, "executed_prefix", None)
    if prefix is not None:
        shape = getattr(prefix, "shape", None)
        if shape is None or len(shape) != 2 or shape[0] < 1 or shape[1] != schema.action_dim \
                or not np.isfinite(np.asarray(prefix, np.float64)).all():
            raise SpecError(f"{who}executed_prefix must be finite numbers [k, {schema.action_dim}], got shape {shape}")
