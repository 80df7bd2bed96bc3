"""The training queue of the Master, as plain data structures (no torch, no I/O, no Dask).

* :class:`TrainingQueue` — large, latency-tolerant work items (RL trajectory batches, SFT batches,
  low-level ops). Highest priority first, FIFO within a priority (``order="priority"``), or plain
  submission order (``order="fifo"``, priorities ignored: ``dispatch.queue_order``); a
  per-tenant admission cap (reserved + queued + running <= ``max_inflight``) gives producers back-pressure so one tenant
  cannot flood the queue; RL items whose policy version lags the tenant's current version by more
  than ``max_staleness`` are dropped (and counted) when they reach the head of the queue.

The inference queue's firing rule lives next to the model: :mod:`nexus.engine.batching`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from nexus.config.service import ServiceLimits
from nexus.control.dispatch.decisions import DecisionTimes

if TYPE_CHECKING:
    from nexus.config.service import ServiceConfig

ItemKind = Literal["rl", "sft", "op"]


class AdmissionError(RuntimeError):
    """An item was offered for a tenant that holds no free admission slot."""


_SERVICE_DEFAULTS = ServiceLimits()


@dataclass
class TenantLimits:
    """A tenant's admission values as the queue applies them (its spec's, filled by ``with_admission_defaults``);
    the defaults here are the service's own (``limits.default_max_*``), not a copy of them."""

    max_inflight: int = _SERVICE_DEFAULTS.default_max_inflight
    max_staleness: int = _SERVICE_DEFAULTS.default_max_staleness
    priority: int = 0

    def __post_init__(self) -> None:
        if self.max_inflight < 1 or self.max_staleness < 0:
            raise ValueError(f"invalid limits {self}: max_inflight >= 1 and max_staleness >= 0 required")


@dataclass
class TrainingItem:
    tenant: str
    kind: ItemKind
    policy_version: int  # version of the policy that produced the data (RL); informative otherwise
    work: Any = None  # what the update does (``nexus.wire.messages.SFTWork`` / ``RLWork`` / ``OpWork``): opaque here
    job: str | None = None
    sync: Any = None  # the weight-sync rule of its new version (``nexus.wire.messages.SyncRule``)
    item_id: str = ""
    enqueued_at: float = 0.0
    attempts: int = 0  # runs that raised (retried up to the dispatcher's item_attempts)
    data: Any = field(default=None, repr=False)  # a low-level op's batch (Dask future), its own task argument


@dataclass
class TenantCounters:
    reserved: int = 0
    queued: int = 0
    running: int = 0
    dispatched: int = 0
    dropped_stale: int = 0
    max_inflight_seen: int = 0

    @property
    def inflight(self) -> int:
        return self.reserved + self.queued + self.running


Order = Literal["fifo", "priority", "critical"]


class TrainingQueue:
    def __init__(self, order: Order = "priority", remaining: Callable[[str], float] = lambda tenant: 0.0) -> None:
        if order not in ("fifo", "priority", "critical"):
            raise ValueError(f"queue order {order!r}: 'fifo', 'priority' or 'critical'")
        self.order = order
        self.remaining = remaining  # tenant -> seconds of training work its running job has left ("critical")
        self.delays: dict[str, deque] = {}  # tenant -> its items' waits in the queue (put -> dispatch), s
        self._heap: list[tuple[float, int, TrainingItem]] = []
        self._seq = itertools.count()
        self.limits: dict[str, TenantLimits] = {}
        self.counters: dict[str, TenantCounters] = {}
        self.times = DecisionTimes()  # how long each queue operation takes (the plugin's decision latency)

    # -- tenants ---------------------------------------------------------------------------
    def set_limits(self, tenant: str, limits: TenantLimits) -> None:
        self.limits[tenant] = limits
        self.counters.setdefault(tenant, TenantCounters())

    def remove_tenant(self, tenant: str) -> list[TrainingItem]:
        """Forget a tenant; returns its items that were still queued."""
        gone = [it for _, _, it in self._heap if it.tenant == tenant]
        self._heap = [e for e in self._heap if e[2].tenant != tenant]
        heapq.heapify(self._heap)
        self.limits.pop(tenant, None)
        self.counters.pop(tenant, None)
        self.delays.pop(tenant, None)
        return gone

    def _c(self, tenant: str) -> TenantCounters:
        if tenant not in self.limits:
            raise KeyError(f"unknown tenant {tenant!r} in the training queue")
        return self.counters[tenant]

    # -- producers -------------------------------------------------------------------------
    def can_reserve(self, tenant: str) -> bool:
        return self._c(tenant).inflight < self.limits[tenant].max_inflight

    def reserve(self, tenant: str) -> bool:
        """Take an admission slot before producing an item (a rollout, an SFT batch)."""
        with self.times.time("reserve"):
            c = self._c(tenant)
            if c.inflight >= self.limits[tenant].max_inflight:
                return False
            c.reserved += 1
            c.max_inflight_seen = max(c.max_inflight_seen, c.inflight)
            return True

    def cancel_reservation(self, tenant: str) -> None:
        c = self._c(tenant)
        if c.reserved <= 0:
            raise AdmissionError(f"tenant {tenant!r} holds no reservation")
        c.reserved -= 1

    def put(self, item: TrainingItem) -> None:
        """Enqueue an item for which a reservation was taken."""
        with self.times.time("put"):
            c = self._c(item.tenant)
            if c.reserved <= 0:
                raise AdmissionError(f"tenant {item.tenant!r} enqueued without a reservation")
            c.reserved -= 1
            c.queued += 1
            seq = next(self._seq)
            item.item_id = item.item_id or f"{item.tenant}-{item.kind}-{seq}"
            item.enqueued_at = time.time()
            heapq.heappush(self._heap, (self._rank(item), seq, item))

    def requeue(self, item: TrainingItem) -> None:
        """A running item goes back to the head of its priority class (its worker was lost, or it is
        retried); it keeps its admission slot."""
        c = self._c(item.tenant)
        if c.running <= 0:
            raise AdmissionError(f"tenant {item.tenant!r} has no running item to requeue")
        c.running -= 1
        c.queued += 1
        heapq.heappush(self._heap, (self._rank(item), -next(self._seq), item))

    def _rank(self, item: TrainingItem) -> float:
        """Lower runs first. 'critical': an RL item unblocks its producers (their admission slots wait for it),
        so RL before SFT, then the longest remaining chain (what bounds the makespan)."""
        if self.order == "priority":
            return -self.limits[item.tenant].priority
        if self.order == "critical":
            return -(1e9 if item.kind == "rl" else 0.0) - self.remaining(item.tenant)
        return 0

    def apply(self, config: ServiceConfig) -> None:
        """A new scheduler: its ``dispatch.queue_order`` ranks the items queued from now on (and re-ranks
        those still queued)."""
        self.order = config.dispatch.queue_order
        self._heap = [(self._rank(it), seq, it) for _, seq, it in self._heap]
        heapq.heapify(self._heap)

    def remove(self, item: TrainingItem) -> bool:
        """Take a queued item out (its job was cancelled): its admission slot is freed. False if not queued."""
        kept = [e for e in self._heap if e[2] is not item]
        if len(kept) == len(self._heap):
            return False
        self._heap = kept
        heapq.heapify(self._heap)
        self.counters[item.tenant].queued -= 1
        return True

    # -- consumer --------------------------------------------------------------------------
    def pop(self, versions: Mapping[str, int]) -> tuple[TrainingItem | None, list[TrainingItem]]:
        """Next item to run, and the stale RL items dropped on the way (their slots are freed)."""
        with self.times.time("pop"):
            return self._pop(versions)

    def _pop(self, versions: Mapping[str, int]) -> tuple[TrainingItem | None, list[TrainingItem]]:
        dropped: list[TrainingItem] = []
        while self._heap:
            _, _, item = heapq.heappop(self._heap)
            c = self.counters[item.tenant]
            c.queued -= 1
            lag = versions.get(item.tenant, 0) - item.policy_version
            if item.kind == "rl" and lag > self.limits[item.tenant].max_staleness:
                c.dropped_stale += 1
                dropped.append(item)
                continue
            c.running += 1
            c.dispatched += 1
            self.delays.setdefault(item.tenant, deque(maxlen=5000)).append(time.time() - item.enqueued_at)
            return item, dropped
        return None, dropped

    def done(self, item: TrainingItem) -> None:
        with self.times.time("done"):
            c = self._c(item.tenant)
            if c.running <= 0:
                raise AdmissionError(f"tenant {item.tenant!r} has no running item")
            c.running -= 1

    # -- views -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._heap)

    def depth(self) -> dict[str, int]:
        return dict(Counter(it.tenant for _, _, it in self._heap))

    def delay_view(self) -> dict[str, dict[str, float]]:
        """Per tenant: how long its items waited in the queue (p50, p99, count; the last 5000)."""
        out = {}
        for tenant, d in self.delays.items():
            xs = sorted(d)
            if xs:
                out[tenant] = {"p50": xs[len(xs) // 2], "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))], "n": len(xs)}
        return out

    def lags(self, versions: dict[str, int]) -> dict[str, int]:
        """Largest version lag among each tenant's queued RL items."""
        out: dict[str, int] = {}
        for _, _, it in self._heap:
            if it.kind == "rl":
                out[it.tenant] = max(out.get(it.tenant, 0), versions.get(it.tenant, 0) - it.policy_version)
        return out
