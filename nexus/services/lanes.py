"""Device lanes of an emulated worker: one worker process holds ``n`` devices of its service (its Dask resource
count), and each piece of work runs on lanes it holds until it ends, so every span is charged to one device
(``<worker>#<lane>``, the slots :mod:`nexus.control.accounting` counts).

A lane may be shared by ``share`` holders (simulator devices running several producers): they hold it at once,
but its device work runs one piece at a time (:meth:`Lanes.occupy`). A holder may say what share of a device's
time it expects to use (its ``load``): then a new holder takes the open lane with the least load held, so two
producers that step most of the time do not end up taking turns on one device while another steps little.
Another service may lend its idle devices to the worker (:class:`LentDevices`): a piece whose own device is busy then
runs there when it is expected to end sooner (:meth:`Lanes.occupy_or_borrow`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from nexus.services.lent_devices import LentDevices, LentPiece


def lane_label(worker_name: str, count: int, lane: int) -> str:
    """A device's slot name: the worker's own name when it holds one device."""
    return str(worker_name) if count <= 1 else f"{worker_name}#{lane}"


class Lanes:
    """``n`` devices, each held by up to ``share`` holders; :meth:`hold` waits until ``k`` lanes have room
    (work beyond the devices queues, as on hardware) and takes the least loaded, then least held ones."""

    def __init__(self, n: int, share: int = 1) -> None:
        if n < 1:
            raise ValueError(f"a worker holds at least one device lane, got {n}")
        if share < 1:
            raise ValueError(f"a lane has room for at least one holder, got {share}")
        self.n, self.share = n, share
        self._holders = [0] * n
        self._load = [0.0] * n  # the holders' expected shares of each device's time, summed
        self._free_at = [0.0] * n  # wall-clock time at which the work queued on each device ends
        self._cv = threading.Condition()

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
        """Queue ``seconds`` of work on ``lane``'s device, arriving ``ahead`` seconds before now (a producer's host
        time still owed, ``DeviceClock.debt``: on the devices' clock it came that much earlier). The device runs
        one piece at a time, in the order asked: returns how long this piece waits, from its arrival, behind the
        work queued before it (0 on an idle device); the caller sleeps the wait plus ``seconds``, less what it
        owes, so its host time meets the device's again when the piece ends."""
        return self.occupy_or_borrow(lane, seconds, ahead)[0]

    def occupy_or_borrow(self, lane: int, seconds: float, ahead: float = 0.0, lent: LentDevices | None = None,
                         unit: float | None = None) -> tuple[float, LentPiece | None]:
        """:meth:`occupy`, or on a device another service lends (``lent``) when the piece is expected to end sooner
        there (``LentDevices.take``): its owner may cut it at a step boundary (steps of ``unit`` seconds), and the
        caller asks again for the rest, or push it back. -> (the wait, the lent piece or None)."""
        with self._cv:
            arrival = time.time() - max(0.0, ahead)
            start = max(arrival, self._free_at[lane])
            if lent is not None and start > arrival:
                piece = lent.take(arrival, seconds, before=start, unit=unit)
                if piece is not None:
                    return piece.start - arrival, piece
            self._free_at[lane] = start + seconds
        return start - arrival, None

    @property
    def busy(self) -> int:
        """Lanes held by anyone."""
        with self._cv:
            return sum(1 for h in self._holders if h)
