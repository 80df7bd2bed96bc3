"""A tenant's fair share of the predict path while it is contended (``qos.fair_share_factor``).

The budgets (:class:`nexus.gateway.serving.Budgets`) bound how many predicts a tenant has *at once*; a tenant
sending ten times the others' rate with short answers stays inside them, and its extra predicts cost gateway
and engine CPU that the other tenants share (measured on 2 cores: the quiet tenants' p99 rose 2-4x). So while
another tenant has a predict queued or running (the path is contended), a tenant whose recent admitted rate is
over ``factor`` times the mean of the other tenants active meanwhile is refused with 429 + ``Retry-After`` before
its observation is checked or queued; while no other tenant's predict is in flight, everyone is admitted (a lone
busy tenant keeps the whole engine). Contention means others in flight, not requests waiting for an engine: at
a few hundred predicts/s the requests seldom wait, yet a loud tenant's CPU still delays the others' answers.

A tenant that has just started (or resumed after ``5 x window_s`` idle) has a rate still rising from 0 towards
what it sends: for the others' mean its rate is scaled up by what the average has reached (``1 - exp(-age /
window_s)``), and under one window old it is not counted yet. Otherwise a tenant alone at ~200/s that became one
of 16 equal tenants at ~60/s each was found over the newcomers' understated mean, and refused, for most of a
second (16 predicts of ~9700 in a 64-client run).
"""

from __future__ import annotations

import math
import time


class FairShare:
    """Each tenant's admitted predicts per second, a decaying average with time constant ``window_s``."""

    def __init__(self, factor: float, window_s: float = 1.0) -> None:
        self.factor, self.window_s = factor, window_s
        self._rate: dict[str, tuple[float, float]] = {}  # tenant -> (rate at t, t)
        self._young: dict[str, float] = {}  # tenant -> when it started, for those under 5 windows old
        # the sum of all tenants' rates, (at t, t): every rate decays alike, so the sum does too, and over() is
        # O(1) per predict however many tenants are active
        self._total = (0.0, 0.0)
        self._pruned = 0.0

    def _decayed(self, value: tuple[float, float], now: float) -> float:
        return value[0] * math.exp(-(now - value[1]) / self.window_s)

    def rate(self, tenant: str, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        return self._decayed(self._rate.get(tenant, (0.0, 0.0)), now)

    def admitted(self, tenant: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if tenant not in self._rate:
            self._young[tenant] = now
        self._rate[tenant] = (self.rate(tenant, now) + 1.0 / self.window_s, now)
        self._total = (self._decayed(self._total, now) + 1.0 / self.window_s, now)

    def over(self, tenant: str, now: float | None = None) -> bool:
        """Whether ``tenant`` is above ``factor`` x the mean rate of the other tenants admitted in the last few
        windows, by more than chance (alone, a tenant is never over)."""
        if self.factor <= 0:
            return False
        now = time.monotonic() if now is None else now
        own = self.rate(tenant, now)
        if own <= 0.0:
            return False
        if now - self._pruned > self.window_s:  # tenants idle for 5 windows no longer count as active
            self._pruned = now
            idle = [k for k, v in self._rate.items() if now - v[1] >= 5 * self.window_s]
            gone = sum(self._decayed(self._rate.pop(k), now) for k in idle)
            self._total = (max(0.0, self._decayed(self._total, now) - gone), now)
            for k in idle:
                self._young.pop(k, None)
        others, counted = self._others(tenant, own, now)
        if counted < 1:
            return False
        # over by more than chance: a margin of one Poisson standard deviation of its own count in a window, so
        # tenants at equal rates are not refused for a burst (e.g. all starting at once, counts still small)
        return own > self.factor * others / counted + math.sqrt(own / self.window_s)

    def _others(self, tenant: str, own: float, now: float) -> tuple[float, int]:
        """The other tenants' summed rate, the young ones' scaled to what they send, and how many are counted."""
        others = max(0.0, self._decayed(self._total, now) - own)
        counted = len(self._rate) - 1
        for k, since in list(self._young.items()):
            age = now - since
            if age >= 5 * self.window_s:  # its average has reached what it sends (within 1 %)
                del self._young[k]
            elif k != tenant:
                raw = self.rate(k, now)
                if age < self.window_s:
                    others, counted = others - raw, counted - 1
                else:
                    others += raw / (1.0 - math.exp(-age / self.window_s)) - raw
        return max(0.0, others), counted
