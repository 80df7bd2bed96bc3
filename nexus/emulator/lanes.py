"""Device lanes of an emulated worker: one worker process holds ``n`` devices of its service (its Dask resource
count), and each piece of work runs on lanes it holds until it ends, so every span is charged to one device
(``<worker>#<lane>``, the slots :mod:`nexus.control.monitoring.accounting` counts).

A lane may be shared by ``share`` holders (simulator devices running several producers): they hold it at once,
but its device work runs one piece at a time, in the order the pieces arrived on the devices' clock
(:meth:`Lanes.place`). A holder may say what share of a device's time it expects to use (its ``load``): then a new
holder takes the open lane with the least load held, so two producers that step most of the time do not end up
taking turns on one device while another steps little.
Another service may lend its idle devices to the worker (:class:`LentDevices`): a piece whose own device is busy then
runs there when it is expected to end sooner."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from nexus.emulator.lent import LentDevices
from nexus.emulator.piece import DevicePiece
from nexus.wire.devices import slot_label

lane_label = slot_label  # a device's slot name: the worker's own when it holds one device, else <worker>#<lane>


class Lanes:
    """``n`` devices, each held by up to ``share`` holders; :meth:`hold` waits until ``k`` lanes have room
    (work beyond the devices queues, as on hardware) and takes the least loaded, then least held ones."""

    def __init__(self, n: int, share: int = 1, now: Callable[[], float] = time.time) -> None:
        """``now``: the wall clock its arrivals are read from (a test's own clock keeps the devices' clock exact)."""
        if n < 1:
            raise ValueError(f"a worker holds at least one device lane, got {n}")
        if share < 1:
            raise ValueError(f"a lane has room for at least one holder, got {share}")
        self.n, self.share, self.now = n, share, now
        self._holders = [0] * n
        self._load = [0.0] * n  # the holders' expected shares of each device's time, summed
        # each device's pieces not over, in their order there, with their arrivals; the end of those over
        self._queue: list[list[tuple[float, DevicePiece]]] = [[] for _ in range(n)]
        self._done_at = [0.0] * n
        self._cv = threading.Condition()
        self.locks = [threading.Lock() for _ in range(n)]  # a device's work on the host's cores: one piece at a time

    def _open(self) -> list[int]:
        return sorted((i for i in range(self.n) if self._holders[i] < self.share),
                      key=lambda i: (self._load[i], self._holders[i], i))

    @contextmanager
    def hold(self, k: int = 1, load: float = 0.0) -> Iterator[list[int]]:
        """``k`` lanes for the block; ``load``: the share of each device's time this holder expects to use (0: not
        said, lanes are told apart by their holders' count alone)."""
        k = max(1, min(k, self.n))
        with self._cv:
            self._cv.wait_for(lambda: len(self._open()) >= k)
            got = self._open()[:k]
            for i in got:
                self._holders[i] += 1
                self._load[i] += load
        try:
            yield got
        finally:
            with self._cv:
                for i in got:
                    self._holders[i] -= 1
                    self._load[i] = max(0.0, self._load[i] - load) if self._holders[i] else 0.0
                self._cv.notify_all()

    def occupy(self, lane: int, seconds: float, ahead: float = 0.0) -> float:
        """:meth:`place` for a caller that does not sleep on its piece (it cannot be pushed back): -> its wait."""
        wait, piece, _ = self.place(lane, seconds, ahead)
        piece.wait_cut(0)
        return wait

    def place(self, lane: int, seconds: float, ahead: float = 0.0, lent: LentDevices | None = None,
              unit: float | None = None, move_s: float = 0.0,
              state_on: str | None = None) -> tuple[float, DevicePiece, bool]:
        """Queue ``seconds`` of work (steps of ``unit``) on ``lane``'s device, arriving ``ahead`` seconds before now (a
        producer's host time still owed, ``DeviceClock.debt``: on the devices' clock it came that much earlier). The
        device runs one piece at a time, in the order they arrived on the devices' clock: this piece goes ahead of
        those queued since its arrival whose producers still sleep on them, and pushes them back
        (:meth:`DevicePiece.push`); it never goes ahead of one whose producer went on. Or, on a device another
        service lends (``lent``), when the piece is expected to end sooner there (``LentDevices.take``: its owner
        may cut it at a step boundary, and the caller asks again for the rest, or push it back).
        -> (its wait from its arrival: 0 on an idle device; the piece, to sleep on with :meth:`DevicePiece.wait_cut`;
        whether it is on a lent device). The caller sleeps the wait plus ``seconds`` and the pushes, less what it
        owes, so its host time meets the device's again when the piece ends. ``state_on``: the lent device holding
        the producer's simulator state (None: its own); a piece run elsewhere first moves it, ``move_s`` (its
        ``lead``: the piece's ``seconds`` are the move and the steps)."""
        with self._cv:
            arrival = self.now() - max(0.0, ahead)
            queue = self._queue[lane]
            over = [p.end for _, p in queue if p.end <= arrival]
            if over:
                self._done_at[lane] = max(self._done_at[lane], *over)
                queue[:] = [(a, p) for a, p in queue if p.end > arrival]
            at = len(queue)  # the host's lateness reorders arrivals: a piece owing more came earlier
            while at > 0 and queue[at - 1][0] > arrival and not queue[at - 1][1].settled:
                at -= 1
            start = max(arrival, queue[at - 1][1].end if at else self._done_at[lane])
            back = move_s if state_on is not None else 0.0  # its state is on a lent device: moved back first
            if lent is not None and (start > arrival or back > 0):
                borrowed = lent.take(arrival, seconds, before=start + back, unit=unit, move_s=move_s,
                                     state_on=state_on)
                if borrowed is not None:
                    return borrowed.start - arrival, borrowed, True
            piece = DevicePiece(str(lane), start, back + seconds, unit, lead=back)
            busy_until = piece.end
            for _, later in queue[at:]:
                later.push(busy_until - later.begins)  # to start when the one before it ends
                busy_until = max(busy_until, later.end)
            queue.insert(at, (arrival, piece))
        return start - arrival, piece, False

    @property
    def busy(self) -> int:
        """Lanes held by anyone."""
        with self._cv:
            return sum(1 for h in self._holders if h)
