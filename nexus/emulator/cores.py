"""Host cores of an emulated simulator worker, for producers whose physics runs on the CPU (robosuite and LIBERO: CPU
MuJoCo, ``ServiceTimes.physics``). Such a producer's GPU lane does none of its stepping, and a GPU lent to it would
gain it nothing: each of its resets and lockstep steps takes ``min(K, n)`` of the worker's ``n`` cores (one per env, as
a vector env of one process per env runs) for its calibrated time, and waits, on the devices' clock, until that many
are free.

Assumes: a step's calibrated time is its time with a core per env (the envs step in parallel); the cores are the
worker's own (the engines' and the actor's host threads are not counted); work is served in the order it arrives on
the devices' clock, first come first served (no piece is pushed back by one that comes later). Rendering, which a
GPU would do for a camera env, is counted as the step's host time.

Times are wall-clock seconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class HostCores:
    """``n`` host cores, each free from some time on (the devices' clock)."""

    def __init__(self, n: int, now: Callable[[], float] = time.time) -> None:
        """``now``: the wall clock arrivals are read from (a test's own keeps the devices' clock exact)."""
        if n < 1:
            raise ValueError(f"a simulator worker has at least one host core, got {n}")
        self.n, self.now = n, now
        self._free_at = [0.0] * n
        self._lock = threading.Lock()

    def place(self, cores: int, seconds: float, ahead: float = 0.0) -> float:
        """``seconds`` of work on ``cores`` cores at once (at most all of them), arriving ``ahead`` seconds before now
        (its producer's host time still owed). -> its wait from its arrival: 0 when that many cores are free."""
        k = max(1, min(cores, self.n))
        with self._lock:
            arrival = self.now() - max(0.0, ahead)
            order = sorted(range(self.n), key=lambda i: self._free_at[i])
            start = max(arrival, self._free_at[order[k - 1]])
            # of the cores free by then, the ones freed last: those free since long are left to a wider piece
            free = [i for i in order if self._free_at[i] <= start]
            for i in free[-k:]:
                self._free_at[i] = start + seconds
            return start - arrival

    @property
    def busy_until(self) -> list[float]:
        with self._lock:
            return sorted(self._free_at)
