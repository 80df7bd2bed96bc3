"""Quality of service, the plain types both sides share: the hops of a predict and latency histograms.

The gateway times each hop of a predict (:data:`HOPS`), answers them in a ``Server-Timing`` header, and
counts each tenant's predict latencies in a :class:`LatencyHistogram` (fixed buckets, so histograms of
several gateways and reports add up); it sends them to the control plane, which shows them on ``/metrics``
(``nexus_predict_latency_seconds``) and the ``/nexus`` page. Plain Python: no torch, no I/O.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

# the hops of one predict, in order (what the README's latency-breakdown table shows)
HOPS = (
    "http",           # ASGI entry -> the route runs: body read, JSON and pydantic parsing (auth excluded)
    "auth",           # the bearer token checked
    "check",          # the observation checked against the tenant's schema, arrays decoded
    "gateway_queue",  # waiting in the gateway's fair queue for a batch to the engine
    "to_engine",      # gateway -> engine -> gateway: the RPC, serialization, the engine's loop (not its queue)
    "engine_queue",   # waiting in the engine's inference queue for the group to fire
    "forward",        # the group's forward (backbone + heads)
    "reply",          # the route's result turned into the HTTP answer
)

# upper bounds in seconds; a last bucket counts everything slower
BUCKETS_S = (0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


@dataclass
class LatencyHistogram:
    """Counts of latencies by bucket (:data:`BUCKETS_S` plus +inf), their sum, and refusals (429)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))
    sum_s: float = 0.0
    rejected: int = 0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.sum_s += seconds

    def add(self, other: LatencyHistogram) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.sum_s += other.sum_s
        self.rejected += other.rejected

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile, linear within its bucket (the last bucket answers its lower bound); None if empty."""
        n = self.count
        if n == 0:
            return None
        rank, seen = q * n, 0
        for i, c in enumerate(self.counts):
            if c and seen + c >= rank:
                lo = 0.0 if i == 0 else BUCKETS_S[i - 1]
                if i == len(BUCKETS_S):
                    return lo
                return lo + (BUCKETS_S[i] - lo) * max(0.0, rank - seen) / c
            seen += c
        return BUCKETS_S[-1]

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (upper bound, count at or below it), ending with +Inf."""
        out, total = [], 0
        for bound, c in zip([*(f"{b:g}" for b in BUCKETS_S), "+Inf"], self.counts, strict=True):
            total += c
            out.append((bound, total))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sum_s": self.sum_s, "rejected": self.rejected}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LatencyHistogram:
        counts = [int(c) for c in d.get("counts", [])]
        if len(counts) != len(BUCKETS_S) + 1 or min(counts, default=0) < 0:
            raise ValueError(f"a latency histogram has {len(BUCKETS_S) + 1} non-negative counts")
        return cls(counts, float(d.get("sum_s", 0.0)), int(d.get("rejected", 0)))

    def summary(self) -> dict[str, Any]:
        p50, p99 = self.quantile(0.5), self.quantile(0.99)
        return {"count": self.count, "rejected": self.rejected,
                "mean_ms": 1e3 * self.sum_s / self.count if self.count else None,
                "p50_ms": None if p50 is None else 1e3 * p50, "p99_ms": None if p99 is None else 1e3 * p99}


def server_timing(spans: dict[str, float]) -> str:
    """A ``Server-Timing`` header value (durations in ms) from hop -> seconds."""
    return ", ".join(f"{k};dur={1e3 * v:.3f}" for k, v in spans.items())


def parse_server_timing(value: str) -> dict[str, float]:
    """hop -> seconds from a ``Server-Timing`` header (what load harnesses read)."""
    out: dict[str, float] = {}
    for part in value.split(","):
        name, _, rest = part.strip().partition(";")
        for p in rest.split(";"):
            k, _, v = p.strip().partition("=")
            if k == "dur" and name:
                try:
                    out[name] = float(v) / 1e3
                except ValueError:
                    pass
    return out
