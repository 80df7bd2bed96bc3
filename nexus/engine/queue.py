"""The Inference Queue, next to the model: requests wait here until their group fires, then the group's
rows run as one forward (``forward``: an awaitable over a flat list of rows) and each request gets its
own rows back.

When a group fires is :class:`~nexus.engine.batching.GroupBatcher`'s rule (B rows, every producer
waiting, nobody expected back before T, or T); this class applies it on the event loop: a timer for the
oldest request's deadline, one group at a time (the running group re-checks when it ends), and the
producers' bookkeeping (open, close, answered) that the "all waiting" rules read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from nexus.engine.batching import GroupBatcher


@dataclass
class Call:
    """One request: the rows a producer asked for at once; answered together."""

    rows: list[Any]
    producer: str | None
    future: asyncio.Future
    t_arrival: float = field(default_factory=time.monotonic)
    lead: float = 0.0  # made this much before it arrived, on its caller's devices' clock


@dataclass(frozen=True)
class Group:
    """A group that ran: its rows, how many requests and why it fired, its compute and wall times."""

    rows: list[Any]
    calls: int
    reason: str
    busy_s: float
    t0: float
    t1: float
    waits_s: list[float]


Forward = Callable[[list[Any]], Awaitable[list[Any]]]


class InferenceQueue:
    def __init__(self, batcher: GroupBatcher, forward: Forward, on_group: Callable[[Group], None]) -> None:
        self.batcher = batcher
        self._forward = forward
        self._on_group = on_group
        self._timer: asyncio.TimerHandle | None = None
        self._firing = False
        # the group's requests' waits, from their arrivals, the firing time, its reason and how much earlier each
        # request was made on the devices' clock, and the group's compute from the measured one: the host's times
        # here (``lead`` unused); an engine modelling its device's time counts that device's
        self.waits_of: Callable[[list[float], float, str, list[float]], list[float]] = (
            lambda arrivals, now, reason, lead: [now - a for a in arrivals])
        self.compute_of: Callable[[float], float] = lambda measured: measured

    def __len__(self) -> int:
        return len(self.batcher)

    # -- producers ------------------------------------------------------------------------------
    def open_producer(self, producer: str, tenant: str | None = None) -> None:
        """Until it closes (or its lease ends), groups wait for it unless it is already waiting itself."""
        self.batcher.open_producer(producer, tenant)

    def close_producer(self, producer: str) -> None:
        self.batcher.close_producer(producer)
        self._schedule()  # its leaving may complete the "all waiting" condition

    def set_limits(self, max_wait_s: float, max_batch: int) -> None:
        """New T and B for the groups formed from now on; pending requests are re-checked at once."""
        self.batcher.set_limits(max_wait_s, max_batch)
        if self._timer is not None:  # armed for the old deadline
            self._timer.cancel()
            self._timer = None
        self._schedule()

    # -- requests -------------------------------------------------------------------------------
    async def submit(self, rows: list[Any], producer: str | None, lead: float = 0.0,
                     deadline: float | None = None) -> tuple[list[Any], float, float, int]:
        """Wait for ``rows``' group -> (their outputs, this request's wait, the group's compute, its rows).
        ``lead``: how much earlier than now the request was made on its caller's devices' clock (the group still
        fires on the host's arrivals). ``deadline`` (``time.monotonic``): the answer is due then; the request's group
        starts by then minus the expected forward."""
        now = time.monotonic()
        call = Call(rows, producer, asyncio.get_running_loop().create_future(), now, lead)
        self.batcher.add(call, rows=len(rows), producer=producer, now=now, deadline=deadline)
        self._schedule()
        return await call.future

    def _schedule(self) -> None:
        if self._firing:
            return  # the running group re-checks when it ends
        due = self.batcher.due_in()
        if due is None:
            return
        if due == 0:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._firing = True
            reason = self.batcher.reason() or "timeout"
            asyncio.get_running_loop().create_task(self._fire(reason))
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(due, self._on_timer)
        elif self._timer.when() > asyncio.get_running_loop().time() + due:  # an earlier deadline arrived
            self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_later(due, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._schedule()

    async def _fire(self, reason: str) -> None:
        calls: list[Call] = self.batcher.take()
        now = time.monotonic()
        group = [r for c in calls for r in c.rows]
        try:
            # before the forward moves its clock
            waits = self.waits_of([c.t_arrival for c in calls], now, reason, [c.lead for c in calls])
            t0, wall0 = time.perf_counter(), time.time()
            outs = await self._forward(group)
            busy = self.compute_of(time.perf_counter() - t0)
            self.batcher.observe_forward(busy)
            self._on_group(Group(group, len(calls), reason, busy, wall0, time.time(),
                                 [w for c, w in zip(calls, waits, strict=True) for _ in c.rows]))
            start = 0
            for c, w in zip(calls, waits, strict=True):
                part = outs[start:start + len(c.rows)]
                start += len(c.rows)
                if not c.future.done():
                    c.future.set_result((part, w, busy, len(group)))
        except Exception as e:
            for c in calls:
                if not c.future.done():
                    c.future.set_exception(e)
        finally:
            self.batcher.answered([c.producer for c in calls])
            self._firing = False
            self._schedule()
