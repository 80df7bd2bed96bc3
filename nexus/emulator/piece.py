"""A piece of device work a producer queued on a simulator device — its own (:class:`nexus.emulator.lanes.Lanes`)
or one another service lends (:class:`nexus.emulator.lent.LentDevices`) — and slept for at once
(:meth:`DevicePiece.wait_cut`): while it sleeps, the piece may still be cut short at a step boundary (a lent device
taken back) or pushed back (other work ran first on the devices' clock); once it has gone on, neither.

Times are wall-clock seconds."""

from __future__ import annotations

import math
import threading
import time


class DevicePiece:
    """``seconds`` of device work queued on ``device`` from ``start``: ``lead`` seconds of moving its producer's
    simulator state there first (no step; kept whole once begun), then steps of ``unit`` seconds."""

    def __init__(self, device: str, start: float, seconds: float, unit: float | None = None,
                 lead: float = 0.0) -> None:
        self.device, self.start, self.seconds = device, start, seconds
        self.lead = min(max(0.0, lead), seconds)
        self.unit = unit if unit and unit > 0 else max(seconds - self.lead, 1e-12)
        self.ran = seconds  # the device seconds it runs: all of them unless it is cut
        self.pushed = 0.0  # seconds other work run first pushed it back (a lent device's owner's, an earlier piece)
        self.missed = 0.0  # ... and what would have pushed it, heard of after its producer went on (too late)
        self.revoked = 0.0  # steps that ran after its owner took the device back, heard of after its producer went on
        self._changed = threading.Condition()
        self._cut = False
        self._settled = False  # its producer has read how much ran and how long it was pushed: final

    @property
    def begins(self) -> float:
        """Its start on the device, after the work run ahead of it (:meth:`push`)."""
        return self.start + self.pushed

    @property
    def end(self) -> float:
        return self.begins + self.ran

    def cut(self, at: float) -> float:
        """No step of the piece begins after ``at``: it ends at the first step boundary from ``at`` on (its start
        when it had not begun). A piece whose producer went on already ran those steps: they are :attr:`revoked`,
        for its producer to run again on its own device (``at`` may be past: the owner's start on its devices'
        clock, which its message reaches a host's dispatch later). -> its end."""
        with self._changed:
            if at < self.end:
                if at <= self.begins:
                    kept = 0.0
                else:  # the state's move, once begun, ends; then the steps begun by ``at``
                    steps = max(0, math.ceil((at - self.begins - self.lead) / self.unit - 1e-9))
                    kept = min(self.ran, self.lead + steps * self.unit)
                if self._settled:
                    self.revoked += self.ran - kept
                else:
                    self._cut = True
                    self._changed.notify_all()
                self.ran = kept
            return self.end

    @property
    def settled(self) -> bool:
        """Its producer has gone on (:meth:`wait_cut` answered): the piece can be neither cut nor pushed back."""
        with self._changed:
            return self._settled

    def take_revoked(self) -> float:
        """The device seconds revoked since last asked (:meth:`cut`)."""
        with self._changed:
            out, self.revoked = self.revoked, 0.0
            return out

    def push(self, seconds: float) -> None:
        """Other work takes device time from it (a lent device's owner's, time-sliced with it, or a piece that came
        earlier on the devices' clock): the piece ends ``seconds`` later (a piece whose producer has gone on is not
        pushed: the push is counted as ``missed``, what the emulation got for free)."""
        with self._changed:
            if seconds > 0 and self._settled:
                self.missed += seconds
            elif seconds > 0:
                self.pushed += seconds
                self._changed.notify_all()

    def wait_cut(self, timeout: float) -> tuple[float, float]:
        """Wait ``timeout`` seconds, plus what the piece is pushed back meanwhile, unless it is cut first: -> (the
        seconds cut off its end, 0 when none; the seconds it was pushed back). What it answers is final: a piece is
        neither cut nor pushed after its producer has gone on."""
        deadline = time.perf_counter() + max(0.0, timeout)
        with self._changed:
            while not self._cut:
                left = deadline + self.pushed - time.perf_counter()
                if left <= 0:
                    break
                self._changed.wait(left)
            self._settled = True  # its producer goes on from here: the device stays its until the piece's end
            return self.seconds - self.ran, self.pushed
