"""The inference queue's firing rule, applied next to the model (in the inference engine).

Requests are collected in arrival order; a request may carry several rows (a producer asks for the
actions of all its envs at once); a group takes tenants in turn (:meth:`GroupBatcher.take`: fair queueing
between the producers' tenants). A group fires when

* ``full``: the pending rows reached the target batch ``max_batch`` (B),
* ``all_waiting``: every live producer already has a request pending or being answered, so nobody
  could join the group (a lone tenant never pays the wait T),
* ``none_expected`` (with ``expect_arrivals``): every live producer is waiting or is not expected back
  before the group's deadline (oldest arrival + T) — each producer's usual gap between an answer and
  its next request (a running mean: the time it steps its envs) tells when it will be back; waiting
  for a producer that is still stepping for the next 200 ms only costs T, it never joins, or
* ``deadline``: a request carries a deadline (a robot's action chunk is due) and the group must start now
  to end by the earliest one: the deadline minus the expected forward (a running mean of the groups'
  forwards) has come; that request goes into this group first, or
* ``timeout``: the oldest request waited ``max_wait_s`` (T).

Producers announce themselves (:meth:`GroupBatcher.open_producer`) and leave
(:meth:`close_producer`); one that sent nothing for ``producer_lease_s`` is treated as gone, so a
producer that died without saying so delays groups by at most T, and only until its lease ends.
Requests without a producer (e.g. a tenant's ``predict_action``) never hold a group back.

Plain data: no torch, no I/O; every method takes an optional ``now`` so tests drive the clock.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

FIRE_REASONS = ("full", "all_waiting", "none_expected", "deadline", "timeout")
GAP_WEIGHT = 0.3  # weight of the newest gap in a producer's running mean
FORWARD_WEIGHT = 0.3  # weight of the newest group's forward in the expected forward


@dataclass
class _Pending:
    t_arrival: float
    rows: int
    producer: str | None
    request: Any
    deadline: float | None = None  # the answer is due then (same clock as ``now``)


@dataclass
class _Producer:
    tenant: str | None
    last_seen: float
    pending: int = 0  # requests of this producer in the queue
    in_flight: int = 0  # requests taken into a group, not answered yet
    answered_at: float | None = None  # when its last request was answered
    gap_s: float | None = None  # running mean of answer -> next request

    def expected_at(self) -> float | None:
        """When its next request should arrive (None: no estimate yet, or it is waiting)."""
        if self.waiting or self.answered_at is None or self.gap_s is None:
            return None
        return self.answered_at + self.gap_s

    @property
    def waiting(self) -> bool:
        return self.pending > 0 or self.in_flight > 0


@dataclass
class GroupBatcher:
    """Firing rule of the inference queue: max wait T (seconds), target batch B (rows) and the
    "every producer is waiting" rule (``fire_when_all_waiting``)."""

    max_wait_s: float = 0.005
    max_batch: int = 8
    fire_when_all_waiting: bool = False  # the service turns it on (DataPathSettings)
    producer_lease_s: float = 5.0
    expect_arrivals: bool = False  # "none_expected" rule (the service turns it on)
    forward_s: float = 0.0  # expected forward of a group: running mean of the measured ones (observe_forward)
    _pending: list[_Pending] = field(default_factory=list)
    _producers: dict[str, _Producer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.set_limits(self.max_wait_s, self.max_batch)
        if self.producer_lease_s <= 0:
            raise ValueError(f"producer_lease_s > 0 required, got {self.producer_lease_s}")

    def set_limits(self, max_wait_s: float, max_batch: int) -> None:
        """T and B for the groups that fire from now on (a scheduler's)."""
        if not (math.isfinite(max_wait_s) and max_wait_s >= 0) or max_batch < 1:
            raise ValueError(f"T >= 0 (finite) and B >= 1 required, got T={max_wait_s}, B={max_batch}")
        self.max_wait_s, self.max_batch = float(max_wait_s), int(max_batch)

    @staticmethod
    def _now(now: float | None) -> float:
        return time.monotonic() if now is None else now

    # -- producers ---------------------------------------------------------------------------
    def open_producer(self, producer: str, tenant: str | None = None, now: float | None = None) -> None:
        p = self._producers.get(producer)
        if p is None:
            self._producers[producer] = _Producer(tenant, self._now(now))
        else:
            p.last_seen = self._now(now)

    def close_producer(self, producer: str) -> None:
        self._producers.pop(producer, None)

    def producers(self, now: float | None = None) -> list[str]:
        """Producers that could still add a request (open and within their lease)."""
        now = self._now(now)
        self._expire(now)
        return list(self._producers)

    # -- requests ----------------------------------------------------------------------------
    def add(self, request: Any, rows: int = 1, producer: str | None = None, now: float | None = None,
            deadline: float | None = None) -> None:
        """Queue a request of ``rows`` rows; ``deadline``: when its answer is due (the group it joins starts by
        then minus the expected forward)."""
        if rows < 1:
            raise ValueError("a request carries at least one row")
        now = self._now(now)
        if producer is not None:
            self.open_producer(producer, now=now)  # a request renews (or re-opens) its producer's lease
            prod = self._producers[producer]
            if prod.answered_at is not None and not prod.waiting:
                gap = now - prod.answered_at
                prod.gap_s = gap if prod.gap_s is None else (1 - GAP_WEIGHT) * prod.gap_s + GAP_WEIGHT * gap
            prod.pending += 1
        if deadline is not None and not math.isfinite(deadline):
            deadline = None
        self._pending.append(_Pending(now, rows, producer, request, deadline))

    def observe_forward(self, seconds: float) -> None:
        """A group's forward took ``seconds``: the expected forward that deadlines leave room for."""
        if math.isfinite(seconds) and seconds >= 0:
            self.forward_s = seconds if self.forward_s == 0 else ((1 - FORWARD_WEIGHT) * self.forward_s
                                                                 + FORWARD_WEIGHT * seconds)

    def latest_start(self) -> float | None:
        """When the next group must start for the earliest deadline pending to be met (None: no deadline)."""
        due = [p.deadline for p in self._pending if p.deadline is not None]
        return min(due) - self.forward_s if due else None

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self._pending)

    def all_waiting(self, now: float | None = None) -> bool:
        """Every live producer has a request pending or in flight (and one request is pending)."""
        if not self._pending:
            return False
        self._expire(self._now(now))
        return all(p.waiting for p in self._producers.values())

    def none_expected(self, now: float | None = None) -> bool:
        """Every live producer is waiting or not expected back before the oldest request's deadline."""
        if not self._pending:
            return False
        self._expire(self._now(now))
        deadline = self._pending[0].t_arrival + self.max_wait_s
        for p in self._producers.values():
            if p.waiting:
                continue
            due = p.expected_at()
            if due is None or due <= deadline:
                return False
        return True

    def _expire(self, now: float) -> None:
        gone = [k for k, p in self._producers.items()
                if not p.waiting and now - p.last_seen > self.producer_lease_s]
        for k in gone:
            del self._producers[k]

    def reason(self, now: float | None = None) -> str | None:
        """Why the next group would fire now (one of :data:`FIRE_REASONS`), or None."""
        if not self._pending:
            return None
        now = self._now(now)
        if self.rows >= self.max_batch:
            return "full"
        if self.fire_when_all_waiting and self.all_waiting(now):
            return "all_waiting"
        if self.fire_when_all_waiting and self.expect_arrivals and self.none_expected(now):
            return "none_expected"
        start = self.latest_start()
        if start is not None and now >= start:
            return "deadline"
        if now - self._pending[0].t_arrival >= self.max_wait_s:
            return "timeout"
        return None

    def due_in(self, now: float | None = None) -> float | None:
        """Seconds until the group must fire (0 = now); None when nothing is pending."""
        if not self._pending:
            return None
        now = self._now(now)
        if self.reason(now) is not None:
            return 0.0
        due = self._pending[0].t_arrival + self.max_wait_s
        start = self.latest_start()
        return max(0.0, min(due, start) - now if start is not None else due - now)

    def _tenant(self, p: _Pending) -> str | None:
        prod = self._producers.get(p.producer) if p.producer is not None else None
        return prod.tenant if prod is not None else None

    def take(self, now: float | None = None) -> list[Any]:
        """The next group: whole requests up to B rows (always at least one request), tenants in turn —
        each tenant's oldest request first, the tenants by their oldest request, then each one's second, … —
        so a tenant with many producers waiting cannot fill every group while another's request waits
        (requests without a producer's tenant count as one tenant; one tenant alone: oldest first). Requests whose
        deadline leaves no more time (see :meth:`latest_start`) go first."""
        now = self._now(now)
        seen: dict[str | None, int] = {}
        ranks = []
        for p in self._pending:
            key = self._tenant(p)
            ranks.append(seen.get(key, 0))
            seen[key] = ranks[-1] + 1
        chosen, rows = set(), 0
        late = [p.deadline is not None and now >= p.deadline - self.forward_s for p in self._pending]
        for i in sorted(range(len(self._pending)), key=lambda i: (not late[i], ranks[i], i)):
            p = self._pending[i]
            if chosen and rows + p.rows > self.max_batch:
                break
            chosen.add(i)
            rows += p.rows
        group = [p for i, p in enumerate(self._pending) if i in chosen]
        self._pending = [p for i, p in enumerate(self._pending) if i not in chosen]
        for p in group:
            prod = self._producers.get(p.producer) if p.producer is not None else None
            if prod is not None:
                prod.pending -= 1
                prod.in_flight += 1
        return [p.request for p in group]

    def answered(self, producers: list[str | None], now: float | None = None) -> None:
        """The requests of a taken group were answered (one entry per request): their producers'
        leases restart now — they step their envs and come back."""
        now = self._now(now)
        for k in producers:
            prod = self._producers.get(k) if k is not None else None
            if prod is not None:
                prod.in_flight = max(0, prod.in_flight - 1)
                prod.last_seen = prod.answered_at = now
