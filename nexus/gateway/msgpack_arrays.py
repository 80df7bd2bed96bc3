"""msgpack with numpy arrays, as openpi's policy server speaks it (``openpi_client/msgpack_numpy.py``).

An array is a msgpack map ``{b"__ndarray__": True, b"data": <bytes>, b"dtype": <numpy dtype str>, b"shape":
[...]}``, a numpy scalar ``{b"__npgeneric__": True, b"data": <value>, b"dtype": <str>}`` (the keys are msgpack
binaries, as openpi's packer writes them). Our own codec, not openpi's: a frame comes from a stranger, so
:func:`unpack` accepts only numeric dtypes (openpi's would build an object array from raw bytes), checks that the
data fills the shape exactly and bounds the elements; anything else is a :class:`MalformedFrame`.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

MAX_ELEMENTS = 1 << 26  # one array of a frame (as nexus.wire.inputs.MAX_ELEMENTS)
NUMERIC_KINDS = "biuf"  # bool, signed, unsigned, float: no objects, strings, records, dates or complex numbers
_ARRAY_KEYS = {b"__ndarray__", b"data", b"dtype", b"shape"}
_SCALAR_KEYS = {b"__npgeneric__", b"data", b"dtype"}


class MalformedFrame(ValueError):
    """A frame that is not msgpack, or whose arrays are not well-formed numeric arrays."""


def _dtype(raw: Any) -> np.dtype:
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", "replace")
    if not isinstance(raw, str) or len(raw) > 16:
        raise MalformedFrame(f"array dtype {raw!r:.40} is not a numpy dtype string")
    try:
        dt = np.dtype(raw)
    except (TypeError, ValueError):
        raise MalformedFrame(f"array dtype {raw!r} is not a numpy dtype") from None
    if dt.kind not in NUMERIC_KINDS or dt.itemsize > 8 or dt.fields is not None or dt.subdtype is not None:
        raise MalformedFrame(f"array dtype {raw!r} is not a plain numeric dtype (bool, int, uint, float)")
    return dt


def _hook(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        if set(obj) != _ARRAY_KEYS:
            raise MalformedFrame(f"an array has exactly the keys {sorted(_ARRAY_KEYS)}")
        dt, shape, data = _dtype(obj[b"dtype"]), obj[b"shape"], obj[b"data"]
        if not isinstance(shape, list | tuple) or len(shape) > 8 or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_ELEMENTS for d in shape):
            raise MalformedFrame(f"array shape {shape!r:.60} is not a list of up to 8 non-negative integers")
        n = math.prod(shape)
        if n > MAX_ELEMENTS:
            raise MalformedFrame(f"array of {n} elements is more than {MAX_ELEMENTS}")
        if not isinstance(data, bytes) or len(data) != n * dt.itemsize:
            size = len(data) if isinstance(data, bytes) else type(data).__name__
            raise MalformedFrame(f"array data ({size} bytes) does not fill shape {list(shape)} of {dt.str} "
                                 f"({n * dt.itemsize} bytes)")
        return np.frombuffer(data, dtype=dt).reshape(shape)
    if b"__npgeneric__" in obj:
        if set(obj) != _SCALAR_KEYS:
            raise MalformedFrame(f"a numpy scalar has exactly the keys {sorted(_SCALAR_KEYS)}")
        dt, value = _dtype(obj[b"dtype"]), obj[b"data"]
        if not isinstance(value, bool | int | float):
            raise MalformedFrame(f"numpy scalar data {type(value).__name__} is not a number")
        try:
            return dt.type(value)
        except (OverflowError, ValueError):
            raise MalformedFrame(f"numpy scalar {value!r:.40} does not fit {dt.str}") from None
    return obj


def unpack(frame: bytes) -> Any:
    """A received frame's value; :class:`MalformedFrame` for anything but well-formed msgpack with numeric arrays."""
    try:
        return msgpack.unpackb(frame, object_hook=_hook, raw=False, strict_map_key=True)
    except MalformedFrame:
        raise
    except Exception as e:  # msgpack's ExtraData / FormatError / StackError / ValueError / UnicodeDecodeError ...
        raise MalformedFrame(f"not a msgpack frame ({type(e).__name__}: {str(e)[:200]})") from None


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in NUMERIC_KINDS:
            raise TypeError(f"unsupported dtype {obj.dtype}")
        obj = np.ascontiguousarray(obj)
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot pack {type(obj).__name__}")


def pack(value: Any) -> bytes:
    """A frame for an openpi client (``msgpack_numpy.unpackb`` reads it)."""
    return msgpack.packb(value, default=_default, use_bin_type=True)
