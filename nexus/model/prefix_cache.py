"""A bounded cache of backbone features per model-facing prefix (an inference engine's, never the actor's).

The frozen backbone's output for a sample depends on its prompt and images and on the LoRA adapter its row
runs through, nothing else: not on the tenant, its head, its version or the proprio state. A state-only
tenant (no cameras) therefore sends the same prefix — its instruction — with every observation, and its
backbone features are the same every step. The cache keeps them, keyed by the backbone's compat key, the
prompt and the adapter, so such a predict runs its tenant's head only.

Keys name an adapter by a serial number given to the adapter *object* the first time it is seen: an engine
replaces a tenant's policy (adapter included) by a new object at every weight sync and never changes one
in place, so a new version's rows can never meet features computed under an old adapter; entries of an
adapter that no longer exists (its version neither live nor pinned) are dropped. Samples with images are
not cached: a camera frame changes every step, so their entries would only push useful ones out.

Bounded in bytes (least recently used out first); thread-safe (the engine's model thread uses it, an
adapter's finalizer may run on any thread).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from nexus.model.backbone_features import BackboneFeatures

NO_ADAPTER = 0  # the base model's rows


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a prefix cache needs a positive size, got {max_bytes} bytes")
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[Hashable, tuple[BackboneFeatures, int]] = OrderedDict()
        self._serials: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._next = itertools.count(NO_ADAPTER + 1)
        self._dead: list[int] = []  # serials of adapters collected since the last lookup
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, compat_key: str, prompt: str, n_images: int, adapter: Any | None) -> Hashable | None:
        """The cache key of one sample under ``adapter`` (None: base model), or None when it is not cached."""
        if n_images:
            return None
        return (compat_key, prompt, self._serial(adapter))

    def get(self, key: Hashable, layers: Sequence[int]) -> BackboneFeatures | None:
        """One row's features with (at least) ``layers``, restricted to them; None on a miss."""
        with self._lock:
            self._purge()
            entry = self._entries.get(key)
            if entry is None or not set(layers) <= set(entry[0].layers):
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
        return entry[0].with_layers(tuple(layers))

    def put(self, key: Hashable, row: BackboneFeatures) -> None:
        """Keep one row's features (detached, its own storage: a slice would pin the whole group's)."""
        row = BackboneFeatures(row.pooled.detach().clone(),
                               None if row.tokens is None else row.tokens.detach().clone(),
                               None if row.mask is None else row.mask.clone(), row.layers)
        size = sum(t.numel() * t.element_size() for t in (row.pooled, row.tokens, row.mask) if t is not None)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._entries[key] = (row, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, freed) = self._entries.popitem(last=False)
                self.bytes -= freed
                self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def reset_counters(self) -> None:
        """Hits, misses and evictions from zero (the entries stay)."""
        self.hits = self.misses = self.evictions = 0

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "bytes": self.bytes, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions}

    def _serial(self, adapter: Any | None) -> int:
        if adapter is None:
            return NO_ADAPTER
        with self._lock:
            serial = self._serials.get(adapter)
            if serial is None:
                serial = self._serials[adapter] = next(self._next)
                weakref.finalize(adapter, self._dead.append, serial)  # list.append: atomic, any thread
        return serial

    def _purge(self) -> None:
        """Drop the entries of collected adapters (under the lock)."""
        if not self._dead:
            return
        dead = set()
        while self._dead:
            dead.add(self._dead.pop())
        for key in [k for k in self._entries if k[2] in dead]:  # type: ignore[index]
            self.bytes -= self._entries.pop(key)[1]
