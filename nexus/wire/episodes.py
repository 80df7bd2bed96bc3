"""Uploaded episodes (external rollouts): the per-step columns a tenant sends, checked once where they enter
(the gateway) and turned into the trajectory store's columns.

Per step, arrays as nested lists or ``{dtype, shape, b64}`` (:func:`nexus.wire.inputs.encode_array`): ``state``
[N, P], ``action`` [N, A] (the policy's own sample, whose ``logprob`` it is), ``reward``, ``logprob``, ``value``
[N] floats, ``terminated``, ``truncated`` [N] booleans, ``policy_version`` [N] ints (the version each action
came from, as ``predict`` answered it), optional ``success`` [N] booleans and ``images`` {camera: uint8 [N, H,
W, 3]}. Episodes are consecutive rows, each ending at its first row with ``terminated`` or ``truncated``; the
last row must end one. Bad input is a :class:`~nexus.errors.SpecError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from nexus.errors import LimitExceeded, SpecError
from nexus.features import TenantSchema
from nexus.wire.inputs import MAX_ABS, decode_array

FLOATS = ("reward", "logprob", "value")
FLAGS = ("terminated", "truncated", "success")
FIELDS = ("state", "action", *FLOATS, *FLAGS, "policy_version", "images")


def _array(raw: Mapping[str, Any], name: str) -> np.ndarray:
    value = raw[name]
    if isinstance(value, list | tuple) and value and all(isinstance(v, bool) for v in value):
        return np.asarray(value, bool)  # JSON true / false (the wire form has no boolean dtype)
    try:
        return decode_array(value)
    except SpecError as e:
        raise SpecError(f"episodes.{name}: {str(e)[:200]}") from None


def _finite(arr: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if tuple(arr.shape) != shape:
        raise SpecError(f"episodes.{name}: shape {tuple(arr.shape)}, expected {shape}")
    if arr.dtype.kind not in "fiub":
        raise SpecError(f"episodes.{name}: numbers expected, got {arr.dtype}")
    arr = arr.astype(np.float32)
    if not np.isfinite(arr).all():
        raise SpecError(f"episodes.{name}: NaN or infinite values")
    if arr.size and np.abs(arr).max() > MAX_ABS:
        raise SpecError(f"episodes.{name}: |value| up to {np.abs(arr).max():.3g}; expected magnitudes <= {MAX_ABS:g}")
    return arr


def _flags(arr: np.ndarray, name: str, n: int) -> np.ndarray:
    if tuple(arr.shape) != (n,) or arr.dtype.kind not in "biu" or (arr.size and not np.isin(arr, (0, 1)).all()):
        raise SpecError(f"episodes.{name}: {n} booleans expected, got {arr.dtype} of shape {tuple(arr.shape)}")
    return arr.astype(bool)


def newest_version(raw: Any) -> int | None:
    """The largest ``policy_version`` of an upload, or None where there is none to read (then
    :func:`check_episodes` says what is wrong)."""
    try:
        versions = _array(raw, "policy_version")
    except (KeyError, TypeError, ValueError, SpecError):
        return None
    return int(versions.max()) if versions.dtype.kind in "iu" and versions.size else None


def check_episodes(raw: Any, schema: TenantSchema, current_version: int, max_rows: int,
                   max_episodes: int) -> dict[str, np.ndarray]:
    """Checked trajectory columns (``episode`` and ``step`` numbered here, from 0) of an upload."""
    if not isinstance(raw, Mapping):
        raise SpecError("episodes: expected an object of per-step columns")
    unknown = sorted(map(str, set(raw) - set(FIELDS)))
    missing = [k for k in FIELDS if k not in raw and k not in ("success", "images")]
    if unknown or missing:
        raise SpecError(f"episodes: unknown field(s) {unknown[:10]}, missing {missing}; the fields are {list(FIELDS)}")
    state = _array(raw, "state")
    n = int(state.shape[0]) if state.ndim else 0
    if n < 1:
        raise SpecError("episodes: no steps")
    if n > max_rows:
        raise LimitExceeded(f"episodes: {n} steps is over the limit max_batch_rows={max_rows}")
    cols: dict[str, np.ndarray] = {"state": _finite(state, "state", (n, schema.proprio_dim)),
                                   "action": _finite(_array(raw, "action"), "action", (n, schema.action_dim))}
    for k in FLOATS:
        cols[k] = _finite(_array(raw, k), k, (n,))
    for k in FLAGS:
        cols[k] = _flags(_array(raw, k), k, n) if k in raw else np.zeros(n, bool)
    versions = _array(raw, "policy_version")
    if tuple(versions.shape) != (n,) or versions.dtype.kind not in "iu":
        raise SpecError(f"episodes.policy_version: {n} integers expected, got {versions.dtype} of shape "
                        f"{tuple(versions.shape)}")
    if versions.size and (versions.min() < 0 or versions.max() > current_version):
        raise SpecError(f"episodes.policy_version: versions {int(versions.min())}..{int(versions.max())}; the tenant's "
                        f"versions so far are 0..{current_version} (send the version predict answered)")
    cols["policy_version"] = versions.astype(np.int64)
    images = raw.get("images") or {}
    if not isinstance(images, Mapping) or set(images) != {c.name for c in schema.cameras}:
        got = sorted(map(str, images)) if isinstance(images, Mapping) else type(images).__name__
        raise SpecError(f"episodes.images: cameras {got}; the tenant's cameras are {[c.name for c in schema.cameras]}")
    for c in schema.cameras:
        img = _array(images, c.name)
        if tuple(img.shape) != (n, c.height, c.width, 3) or img.dtype != np.uint8:
            raise SpecError(f"episodes.images.{c.name}: uint8 of shape {(n, c.height, c.width, 3)} expected, got "
                            f"{img.dtype} of shape {tuple(img.shape)}")
        cols[f"image.{c.name}"] = img
    done = cols["terminated"] | cols["truncated"]
    if not done[-1]:
        raise SpecError("episodes: the last step ends no episode (terminated or truncated): upload whole episodes")
    starts = np.concatenate([[0], np.flatnonzero(done[:-1]) + 1])
    if len(starts) > max_episodes:
        raise LimitExceeded(f"episodes: {len(starts)} episodes is over the limit max_episodes_per_batch={max_episodes}")
    episode = np.cumsum(np.concatenate([[0], done[:-1].astype(np.int64)]))
    cols["episode"] = episode
    cols["step"] = (np.arange(n) - starts[episode]).astype(np.int32)
    return cols
