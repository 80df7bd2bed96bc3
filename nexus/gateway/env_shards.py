"""A sharded environment session's calls in the gateway: one call split by env over the session's shards
(each a contiguous share of its envs on one simulator worker, :mod:`nexus.control.tenants.env_sessions`), and their
answers joined back into the one answer the client expects.

The workers answer in JSON with arrays in their wire form (:func:`nexus.wire.inputs.encode_array`), every array's
first axis the envs; joining concatenates their bytes, so no array is decoded into numpy here.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

from nexus.wire.inputs import encode_array

ARRAY_KEYS = frozenset({"dtype", "shape", "b64"})


def offsets(sizes: list[int]) -> list[tuple[int, int]]:
    """Each shard's ``[start, stop)`` of the session's envs."""
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


def split_reset(sizes: list[int], seeds: list[int | None], mask: list[bool] | None) -> list[dict[str, Any]]:
    return [{"seeds": seeds[a:b], "mask": None if mask is None else mask[a:b]} for a, b in offsets(sizes)]


def split_step(sizes: list[int], actions: np.ndarray) -> list[dict[str, Any]]:
    """msgpack-ready parts (float32 bytes and shape, as a whole step's actions travel)."""
    parts = [np.ascontiguousarray(actions[a:b], np.float32) for a, b in offsets(sizes)]
    return [{"actions": p.tobytes(), "shape": list(p.shape)} for p in parts]


def join_answers(answers: list[bytes]) -> bytes:
    """The shards' JSON answers as one: arrays concatenated along the envs, in shard order. With autoreset
    only some shards may have had an episode end (``final``); the others' rows of ``final`` are masked out."""
    docs = [json.loads(a) for a in answers]
    if any("final" in d for d in docs):
        for d in docs:
            if "final" not in d:  # no env of this shard ended: mask 0, its observations as placeholders
                n = d["obs"]["state"]["shape"][0]
                d["final"] = {"mask": encode_array(np.zeros(n, np.uint8)), **d["obs"]}
    return json.dumps(_join(docs), separators=(",", ":")).encode()


def _join(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, dict) and set(first) == ARRAY_KEYS:
        data = b"".join(base64.b64decode(p["b64"]) for p in parts)
        rows = sum(int(p["shape"][0]) for p in parts)
        return {"dtype": first["dtype"], "shape": [rows, *first["shape"][1:]], "b64": base64.b64encode(data).decode()}
    if isinstance(first, dict):
        return {k: _join([p[k] for p in parts]) for k in first}
    return first
