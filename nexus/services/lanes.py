"""Device lanes of an emulated worker: one worker process holds ``n`` devices of its service (its Dask resource
count), and each piece of work runs on lanes it holds until it ends, so every span is charged to one device
(``<worker>#<lane>``, the slots :mod:`nexus.control.accounting` counts)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


def lane_label(worker_name: str, count: int, lane: int) -> str:
    """A device's slot name: the worker's own name when it holds one device."""
    return str(worker_name) if count <= 1 else f"{worker_name}#{lane}"


class Lanes:
    """``n`` devices; :meth:`hold` waits until ``k`` are free (work beyond the devices queues, as on hardware)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a worker holds at least one device lane, got {n}")
        self.n = n
        self._free = list(range(n))
        self._cv = threading.Condition()

    @contextmanager
    def hold(self, k: int = 1) -> Iterator[list[int]]:
        k = max(1, min(k, self.n))
        with self._cv:
            self._cv.wait_for(lambda: len(self._free) >= k)
            self._free.sort()
            got, self._free = self._free[:k], self._free[k:]
        try:
            yield got
        finally:
            with self._cv:
                self._free.extend(got)
                self._cv.notify_all()

    @property
    def busy(self) -> int:
        with self._cv:
            return self.n - len(self._free)
