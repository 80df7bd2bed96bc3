"""What an inference engine counts: its groups (sizes, requests, tenants, why they fired) and the metering
signal that charges each group's compute to its tenants and jobs (sent at most once a second)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from nexus.wire.signals import emit


@dataclass
class EngineStats:
    groups: int = 0
    requests: int = 0  # rows
    calls: int = 0
    busy_s: float = 0.0
    group_sizes: list[int] = field(default_factory=list)  # rows per group, last 1000
    waits_s: list[float] = field(default_factory=list)  # last 1000
    size_hist: Counter = field(default_factory=Counter)  # rows per group -> groups (whole run)
    calls_hist: Counter = field(default_factory=Counter)  # requests per group -> groups
    tenants_hist: Counter = field(default_factory=Counter)  # tenants per group -> groups
    reasons: Counter = field(default_factory=Counter)  # why groups fired (GroupBatcher reasons)
    tenant_waits: dict[str, deque] = field(default_factory=dict)  # tenant -> its rows' waits, last 20000

    def record(self, size: int, waits: list[float], busy: float, calls: int = 1, tenants: int = 1,
               reason: str = "timeout", row_tenants: list[str] | None = None) -> None:
        self.groups += 1
        self.requests += size
        self.calls += calls
        self.busy_s += busy
        self.group_sizes = (self.group_sizes + [size])[-1000:]
        self.waits_s = (self.waits_s + waits)[-1000:]
        self.size_hist[size] += 1
        self.calls_hist[calls] += 1
        self.tenants_hist[tenants] += 1
        self.reasons[reason] += 1
        for tenant, w in zip(row_tenants or (), waits, strict=False):  # action-request queueing delay by tenant
            self.tenant_waits.setdefault(tenant, deque(maxlen=20_000)).append(w)

    def view(self) -> dict[str, Any]:
        def hist(c: Counter) -> dict[str, int]:
            return {str(k): int(v) for k, v in sorted(c.items())}

        return {"groups": self.groups, "requests": self.requests, "calls": self.calls, "busy_s": self.busy_s,
                "group_sizes": list(self.group_sizes), "waits_s": list(self.waits_s),
                "size_hist": hist(self.size_hist), "calls_hist": hist(self.calls_hist),
                "tenants_hist": hist(self.tenants_hist), "reasons": dict(self.reasons),
                "tenant_waits": {t: list(w) for t, w in self.tenant_waits.items()}}


def _empty() -> dict[str, Any]:
    return {"busy_s": 0.0, "by_tenant": {}, "by_job": {}, "spans": [], "sizes": [], "waits": []}


class EngineMeter:
    """The ``inference`` monitoring signal: each group's busy time split over its tenants (and jobs) by their
    share of its rows, its span, size and waits; flushed at most once a second (``pending``: the requests
    still queued at the engine, sent along; ``device``: the slot its spans are charged to, when it is not the
    worker itself — a worker holding several devices, an engine each)."""

    def __init__(self, pending=lambda: 0, device: str | None = None) -> None:
        self._pending = pending
        self._device = {"device": device} if device else {}
        self._signal = _empty()
        self._last_flush = time.time()
        self._timer: asyncio.TimerHandle | None = None

    def account(self, tenants: list[str], jobs: list[str | None], t0: float, t1: float, busy: float,
                waits: list[float]) -> None:
        counts = Counter(tenants)
        acc, n = self._signal, len(tenants)
        acc["busy_s"] += busy
        for tenant, c in counts.items():
            acc["by_tenant"][tenant] = acc["by_tenant"].get(tenant, 0.0) + busy * c / n
        for job, c in Counter(j for j in jobs if j).items():
            acc["by_job"][job] = acc["by_job"].get(job, 0.0) + busy * c / n
        acc["spans"].append((t0, t1, sorted(counts)))
        acc["sizes"].append(n)
        acc["waits"].extend(waits)
        if time.time() - self._last_flush >= 1.0:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(1.0, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._signal["sizes"]:
            emit("inference", **self._signal, pending=self._pending(), **self._device)
        self._signal = _empty()
        self._last_flush = time.time()
