"""Checks of what tenants send: observations and low-level training batches (numpy only, no torch).

Used at the gateway (before anything reaches Dask) and again where the data is consumed (the actor's
low-level ops, the inference engine), so a bad datum never becomes a raw numpy / torch error or a NaN
in a tenant's weights. Every refusal is a :class:`nexus.errors.SpecError` whose message names the
field, what was expected and what came.

One observation layout everywhere: ``{"state": [P], "images": {camera: uint8 [H, W, 3]}, "instruction": str}``
(``images`` and ``instruction`` optional where the tenant has no camera / wants its own instruction): what
``predict`` takes, what an environment session answers (batched: a leading env axis), what an exported policy's
``predict_action`` takes and what a dataset yields (``OfflineDataset.rows``). Only Stable-Baselines3, which
takes no nested ``Dict``, sees it flattened (:func:`flat_observation`: ``images.<camera>`` keys).

Arrays arrive as numpy arrays, nested lists of numbers, or the wire form of :func:`encode_array`
(``{"dtype", "shape", "b64"}``: exact and compact in JSON).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import ValidationError

from nexus.algorithms.grpo import GRPOConfig
from nexus.algorithms.ppo import PPOConfig
from nexus.errors import LimitExceeded, SpecError, describe_errors, quote
from nexus.features import Observation, TenantSchema

WIRE_DTYPES = {"float32": np.float32, "float64": np.float64, "uint8": np.uint8, "int64": np.int64,
               "int32": np.int32}
OBSERVATION_FIELDS = ("state", "images", "instruction")
BATCH_FIELDS = {
    "sft": ("observations", "actions"),
    "ppo": ("observations", "actions", "logprobs", "advantages", "returns", "ppo"),
    "grpo": ("observations", "actions", "logprobs", "advantages", "ref_logprobs", "grpo"),
}
GRPO_FIELDS = tuple(GRPOConfig.model_fields)
MAX_ELEMENTS = 1 << 26  # one array of a request: 64 Mi elements, far above any real observation
MAX_ABS = 1e6  # states, actions and RL fields: larger magnitudes overflow float32 losses (x**2 > 3.4e38)


FLAT_IMAGE_PREFIX = "images."  # flat_observation's camera keys


def flat_observation(obs: Mapping[str, Any]) -> dict[str, Any]:
    """``{"state", "images": {cam: a}}`` -> ``{"state", "images.<cam>": a}`` (SB3's ``MultiInputPolicy`` takes no
    nested ``Dict``); the instruction, a string, is left out."""
    return {"state": obs["state"], **{f"{FLAT_IMAGE_PREFIX}{c}": v for c, v in (obs.get("images") or {}).items()}}


def nested_observation(obs: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`flat_observation` (an observation already nested passes as it is)."""
    flat = [k for k in obs if isinstance(k, str) and k.startswith(FLAT_IMAGE_PREFIX)]
    if not flat:
        return dict(obs)
    out = {k: v for k, v in obs.items() if k not in flat}
    out["images"] = {**(out.get("images") or {}), **{k.removeprefix(FLAT_IMAGE_PREFIX): obs[k] for k in flat}}
    return out


def encode_array(a: Any) -> dict[str, Any]:
    """The JSON wire form of an array (what the HTTP client sends)."""
    a = np.ascontiguousarray(a)
    if a.dtype.name not in WIRE_DTYPES:
        a = a.astype(np.float32)
    return {"dtype": a.dtype.name, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}


def wire(x: Any) -> Any:
    """JSON-ready answer: arrays in their exact wire form (booleans as uint8), numpy scalars as numbers."""
    if isinstance(x, np.ndarray):
        return encode_array(x.astype(np.uint8) if x.dtype == np.bool_ else x)
    if isinstance(x, dict):
        return {k: wire(v) for k, v in x.items()}
    if isinstance(x, np.generic):
        return x.item()
    return x


def wire_json(x: Any) -> bytes:
    """:func:`wire`'s answer as JSON bytes: what a simulator worker sends back for an environment session's
    call, so the gateway passes it on as is (one bytes frame through Dask, no re-encoding)."""
    return json.dumps(wire(x), allow_nan=False, separators=(",", ":")).encode()


def decode_array(value: Any) -> np.ndarray:
    """The inverse of :func:`encode_array` (lists and arrays pass through :func:`_as_array`)."""
    return _as_array(value, "array", None)


def _kind(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} ({value.dtype})"
    if isinstance(value, str):
        return f"a string {value[:20]!r}"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)}"
    return "null" if value is None else type(value).__name__


def _as_array(value: Any, field: str, expected: str | None) -> np.ndarray:
    what = f"; expected {expected}" if expected else ""
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, Mapping):
        if set(value) != {"dtype", "shape", "b64"}:
            raise SpecError(f"{field}: an encoded array has exactly the keys dtype, shape, b64; got "
                            f"{quote(sorted(map(str, value)))}{what}")
        dtype = WIRE_DTYPES.get(value["dtype"]) if isinstance(value["dtype"], str) else None
        shape = value["shape"]
        if dtype is None:
            raise SpecError(f"{field}: dtype {quote(value['dtype'])} is not one of {sorted(WIRE_DTYPES)}")
        if not isinstance(shape, list | tuple) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                          and 0 <= d <= MAX_ELEMENTS for d in shape):
            raise SpecError(f"{field}: shape must be a list of non-negative integers, got {quote(shape)}")
        if math.prod(shape) > MAX_ELEMENTS:
            raise SpecError(f"{field}: {math.prod(shape)} elements is more than {MAX_ELEMENTS}")
        if not isinstance(value["b64"], str):
            raise SpecError(f"{field}: b64 must be a base64 string, got {_kind(value['b64'])}")
        try:
            raw = base64.b64decode(value["b64"], validate=True)
        except (binascii.Error, ValueError):
            raise SpecError(f"{field}: b64 is not valid base64") from None
        itemsize = np.dtype(dtype).itemsize
        if len(raw) != math.prod(shape) * itemsize:
            raise SpecError(f"{field}: {len(raw)} bytes do not fit shape {list(shape)} of {value['dtype']} "
                            f"({math.prod(shape) * itemsize} bytes)")
        arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
    elif isinstance(value, list | tuple):
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError):
            raise SpecError(f"{field}: a ragged list (rows of different lengths){what}") from None
        if arr.dtype == object:
            raise SpecError(f"{field}: not an array of numbers (mixed types, or integers too large){what}")
        if arr.size > MAX_ELEMENTS:
            raise SpecError(f"{field}: {arr.size} elements is more than {MAX_ELEMENTS}")
    elif isinstance(value, int | float) and not isinstance(value, bool):
        arr = np.asarray(value)
    else:
        raise SpecError(f"{field}: got {_kind(value)}{what}")
    if arr.dtype.kind not in "biuf" or arr.dtype.kind == "b":
        raise SpecError(f"{field}: got {arr.dtype.kind == 'b' and 'booleans' or 'non-numbers'} "
                        f"({_kind(arr)}){what}")
    return arr


def _floats(value: Any, field: str, shape: tuple[int | None, ...], expected: str) -> np.ndarray:
    arr = _as_array(value, field, expected)
    if arr.ndim != len(shape) or any(want is not None and got != want for got, want in zip(arr.shape, shape,
                                                                                          strict=False)):
        raise SpecError(f"{field}: expected {expected}, got shape {tuple(arr.shape)}")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        bad = int((~np.isfinite(arr)).sum())
        raise SpecError(f"{field}: {bad} value(s) are NaN or infinite; expected finite numbers")
    if arr.size and np.abs(arr).max() > MAX_ABS:
        raise SpecError(f"{field}: |value| up to {np.abs(arr).max():.3g}; expected magnitudes <= {MAX_ABS:g}")
    return arr.astype(np.float32)


def check_prefix(value: Any, chunk: int, action_dim: int, field: str = "executed_prefix") -> np.ndarray:
    """A robot's executed prefix of its previous chunk (real-time chunking): float32 [k, action_dim] finite numbers,
    1 <= k <= ``chunk`` (the tenant's chunk); a list of k action lists, an encoded array or an array."""
    expected = f"[k, {action_dim}] numbers with 1 <= k <= {chunk} (the tenant's chunk)"
    arr = _floats(value, field, (None, action_dim), expected)
    if not 1 <= arr.shape[0] <= chunk:
        raise SpecError(f"{field}: expected {expected}, got shape {tuple(arr.shape)}")
    return arr


def attach_prefix(obs: Observation, value: Any, chunk: int, action_dim: int, action_head: str, sample: bool,
                  field: str = "executed_prefix") -> Observation:
    """``obs`` with its checked executed prefix (:func:`check_prefix`; None: none). A sample of the Gaussian (oft)
    head is refused with one: its log-probability would not be the returned chunk's (the prefix replaces its first
    actions), and RL trains on it."""
    if value is None:
        return obs
    prefix = check_prefix(value, chunk, action_dim, field)
    if sample and action_head == "oft":
        raise SpecError(f"{field}: real-time chunking serves the oft head's mean chunk, not a sample (its "
                        "log-probability would not be the returned chunk's): send it with a deterministic request")
    obs.executed_prefix = prefix
    return obs


def check_observation(obs: Any, schema: TenantSchema, *, field: str = "observation",
                      max_instruction_chars: int = 2000) -> Observation:
    """A checked copy of a raw observation (an :class:`Observation` or a dict of its fields)."""
    if isinstance(obs, Observation):
        raw: Mapping[str, Any] = {"state": obs.state, "images": obs.images, "instruction": obs.instruction}
    elif isinstance(obs, Mapping):
        raw = obs
        unknown = sorted(map(str, set(raw) - set(OBSERVATION_FIELDS)))
        if unknown:
            raise SpecError(f"{field}: unknown field(s) {unknown}; an observation has {list(OBSERVATION_FIELDS)}")
    else:
        raise SpecError(f"{field}: expected an observation (state, images, instruction), got {_kind(obs)}")
    p = schema.proprio_dim
    if "state" not in raw:
        raise SpecError(f"{field}.state: missing; expected {p} numbers")
    state = _floats(raw["state"], f"{field}.state", (p,), f"{p} numbers (the tenant's proprio state)")
    images_raw = raw.get("images") or {}
    if not isinstance(images_raw, Mapping):
        raise SpecError(f"{field}.images: expected an object camera -> image, got {_kind(images_raw)}")
    cams = {c.name: c for c in schema.cameras}
    unknown = sorted(map(str, set(images_raw) - set(cams)))
    if unknown:
        raise SpecError(f"{field}.images: unknown camera(s) {unknown}; the tenant's cameras are {sorted(cams)}")
    images: dict[str, np.ndarray] = {}
    for name, cam in cams.items():
        f = f"{field}.images.{name}"
        shape = (cam.height, cam.width, 3)
        if name not in images_raw:
            raise SpecError(f"{f}: missing; expected a uint8 image of shape {shape}")
        img = _as_array(images_raw[name], f, f"uint8 values of shape {shape}")
        if tuple(img.shape) != shape:
            raise SpecError(f"{f}: expected shape {shape}, got {tuple(img.shape)}")
        if img.dtype != np.uint8:
            if img.dtype.kind == "f" and not np.isfinite(img).all():
                raise SpecError(f"{f}: NaN or infinite pixels; expected uint8 values 0..255")
            if img.size and (img.min() < 0 or img.max() > 255 or (img.dtype.kind == "f" and (img % 1).any())):
                raise SpecError(f"{f}: expected uint8 values 0..255, got {img.dtype} in "
                                f"[{img.min()}, {img.max()}]")
            img = img.astype(np.uint8)
        images[name] = np.ascontiguousarray(img)
    instruction = raw.get("instruction", "")
    if instruction is None:
        instruction = ""
    if not isinstance(instruction, str):
        raise SpecError(f"{field}.instruction: expected a string, got {_kind(instruction)}")
    if len(instruction) > max_instruction_chars:
        raise LimitExceeded(f"{field}.instruction: {len(instruction)} characters is over the limit "
                        f"max_instruction_chars={max_instruction_chars}")
    return Observation(state=state, images=images, instruction=instruction)


def _config(value: Any, field: str, allowed: tuple[str, ...]) -> dict[str, float | int | bool | None]:
    if not isinstance(value, Mapping):
        raise SpecError(f"{field}: expected an object with fields {list(allowed)}, got {_kind(value)}")
    unknown = sorted(map(str, set(value) - set(allowed)))
    if unknown:
        raise SpecError(f"{field}: unknown field(s) {unknown}; allowed {list(allowed)}")
    for k, v in value.items():
        if v is not None and not isinstance(v, int | float | bool):
            raise SpecError(f"{field}.{k}: expected a number, got {_kind(v)}")
        if isinstance(v, float) and not math.isfinite(v):
            raise SpecError(f"{field}.{k}: expected a finite number, got {v}")
    return dict(value)


def check_batch(batch: Any, schema: TenantSchema, loss: str, *, chunk: int = 1,
                max_rows: int = 4096, max_instruction_chars: int = 2000) -> dict[str, Any]:
    """A checked copy of a ``forward_backward`` batch: observations as :class:`Observation`, numeric
    fields as finite float32 arrays (``actions`` flattened to [N, chunk * action_dim])."""
    if loss not in BATCH_FIELDS:
        raise SpecError(f"loss: unknown loss {quote(loss)}; expected one of {sorted(BATCH_FIELDS)}")
    if loss != "sft" and chunk != 1:
        raise SpecError(f"loss {loss!r}: RL trains one action per step, but the tenant's chunk={chunk}")
    if not isinstance(batch, Mapping):
        raise SpecError(f"batch: expected an object with fields {list(BATCH_FIELDS[loss])}, got {_kind(batch)}")
    allowed = BATCH_FIELDS[loss]
    unknown = sorted(map(str, set(batch) - set(allowed)))
    if unknown:
        raise SpecError(f"batch: unknown field(s) {quote(unknown)} for loss {loss!r}; allowed {list(allowed)}")
    obs = batch.get("observations")
    if not isinstance(obs, list | tuple):
        raise SpecError(f"batch.observations: expected a list of observations, got {_kind(obs)}")
    n = len(obs)
    if n == 0:
        raise SpecError("batch.observations: the batch is empty; expected at least one observation")
    if n > max_rows:
        raise LimitExceeded(f"batch.observations: {n} rows is over the limit max_batch_rows={max_rows}")
    out: dict[str, Any] = {"observations": [
        check_observation(o, schema, field=f"batch.observations[{i}]", max_instruction_chars=max_instruction_chars)
        for i, o in enumerate(obs)]}
    a = schema.action_dim
    if "actions" not in batch:
        raise SpecError(f"batch.actions: missing; expected {n} x {chunk * a} numbers")
    arr = _as_array(batch["actions"], "batch.actions", f"shape ({n}, {chunk * a})")
    if chunk > 1 and arr.ndim == 3:
        arr = _floats(arr, "batch.actions", (n, chunk, a), f"shape ({n}, {chunk}, {a})").reshape(n, chunk * a)
    else:
        arr = _floats(arr, "batch.actions", (n, chunk * a), f"shape ({n}, {chunk * a}): one row of "
                      f"{chunk * a} numbers per observation")
    out["actions"] = arr
    required = {"ppo": ("logprobs", "advantages", "returns"), "grpo": ("logprobs", "advantages")}.get(loss, ())
    for k in (*required, "ref_logprobs"):
        if k not in batch:
            if k in required:
                raise SpecError(f"batch.{k}: missing; loss {loss!r} needs {n} numbers")
            continue
        if batch[k] is None and k == "ref_logprobs":
            continue
        out[k] = _floats(batch[k], f"batch.{k}", (n,), f"{n} numbers (one per observation)")
    if loss == "ppo" and "ppo" in batch:
        if not isinstance(batch["ppo"], Mapping):
            raise SpecError(f"batch.ppo: expected an object of PPOConfig fields, got {_kind(batch['ppo'])}")
        try:
            out["ppo"] = PPOConfig.model_validate(dict(batch["ppo"])).model_dump()
        except ValidationError as e:
            raise SpecError(f"batch.ppo: {describe_errors(e.errors())}") from None
    if loss == "grpo" and "grpo" in batch:
        out["grpo"] = _config(batch["grpo"], "batch.grpo", GRPO_FIELDS)
    return out
