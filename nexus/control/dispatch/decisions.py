"""How long the control plane's decisions take, per operation, timed where they are made (on the scheduler's
event loop): the training queue's reserve / put / pop / done, the dispatcher's pump, routing a tenant.

A bounded reservoir of the most recent durations per operation (so the view's percentiles describe now, and
memory never grows); ``view()`` gives count, p50, p99 and max in microseconds.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any


class _Timer:
    __slots__ = ("times", "op", "t0")

    def __init__(self, times: DecisionTimes, op: str) -> None:
        self.times, self.op = times, op

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.times.record(self.op, time.perf_counter() - self.t0)


class DecisionTimes:
    def __init__(self, keep: int = 4096) -> None:
        self.keep = keep
        self._recent: dict[str, deque[float]] = {}
        self.counts: Counter[str] = Counter()

    def time(self, op: str) -> _Timer:
        """``with times.time("pop"): ...``"""
        return _Timer(self, op)

    def record(self, op: str, seconds: float) -> None:
        d = self._recent.get(op)
        if d is None:
            d = self._recent[op] = deque(maxlen=self.keep)
        d.append(seconds)
        self.counts[op] += 1

    def view(self) -> dict[str, dict[str, Any]]:
        out = {}
        for op, d in sorted(self._recent.items()):
            s = sorted(d)
            out[op] = {"count": self.counts[op], "p50_us": 1e6 * s[len(s) // 2],
                       "p99_us": 1e6 * s[min(len(s) - 1, int(0.99 * len(s)))], "max_us": 1e6 * s[-1]}
        return out
