"""Devices of another service lent to a simulator worker while their own service leaves them idle
(``EmulationSettings.lend_actor``): the emulated actor rank lends its devices when an update ends and takes them
back when the next one arrives. While lent, a producer whose own device is busy may run its next piece of device
work (a reset, or the env steps of an action chunk) on one of them, as one :class:`LentPiece`. Taken back, a device
starts no new step: a piece running on it is cut at its next step boundary (its producer, woken, does the rest on
its own device), and its owner starts its own work then (:meth:`LentDevices.reclaim` says when). A piece is one
sleep of its producer however many steps it holds, so lending costs the host no more per step than stepping on
its own device.

Times are wall-clock seconds: the lender is another process on the same host."""

from __future__ import annotations

import math
import threading


class LentPiece:
    """``seconds`` of device work queued on lent ``device`` from ``start``, in steps of ``unit`` seconds."""

    def __init__(self, device: str, start: float, seconds: float, unit: float | None = None) -> None:
        self.device, self.start, self.seconds = device, start, seconds
        self.unit = unit if unit and unit > 0 else seconds
        self.ran = seconds  # the device seconds it runs: all of them unless it is cut
        self._cut = threading.Event()
        self._lock = threading.Lock()
        self._settled = False  # its producer has read how much ran: no longer cut

    @property
    def end(self) -> float:
        return self.start + self.ran

    def cut(self, at: float) -> float:
        """No step of the piece begins after ``at``: it ends at the first step boundary from ``at`` on (its start
        when it had not begun). -> its end."""
        with self._lock:
            if not self._settled and at < self.end:
                steps = max(0, math.ceil((at - self.start) / self.unit - 1e-9))
                self.ran = min(self.ran, steps * self.unit)
                self._cut.set()
            return self.end

    def wait_cut(self, timeout: float) -> float:
        """Wait up to ``timeout`` seconds for the piece to be cut: -> the seconds cut off its end (0: none). What it
        answers is final: a piece is not cut after its producer has gone on."""
        self._cut.wait(max(0.0, timeout))
        with self._lock:
            self._settled = True  # its producer goes on from here: the device stays its until the piece's end
            return self.seconds - self.ran


class LentDevices:
    def __init__(self) -> None:
        self._free_at: dict[str, float] = {}  # device -> end of the work queued on it (wall clock)
        self._pieces: dict[str, list[LentPiece]] = {}  # device -> its pieces, the last of them not yet over
        self._open: set[str] = set()  # devices lent now
        self._lock = threading.Lock()

    def lend(self, devices: list[str], free_at: float) -> None:
        """``devices`` take pieces from ``free_at`` on (their owner's last work ends then)."""
        with self._lock:
            for d in devices:
                self._free_at[d] = max(self._free_at.get(d, 0.0), free_at)
                self._open.add(d)

    def reclaim(self, devices: list[str], at: float) -> float:
        """Take ``devices`` back at ``at`` (wall clock): no new piece starts on them and the pieces queued on them
        are cut at their next step boundary. -> when those end (0 when none was ever queued)."""
        with self._lock:
            self._open.difference_update(devices)
            for d in devices:
                pieces = self._pieces.pop(d, [])
                for piece in pieces:
                    piece.cut(at)
                if pieces:  # the last piece that runs a step ends the device's work; else its work before them did
                    ran = [p.end for p in pieces if p.ran > 0]
                    self._free_at[d] = max(ran) if ran else pieces[0].start
            return max((self._free_at.get(d, 0.0) for d in devices), default=0.0)

    def take(self, earliest: float, seconds: float, before: float, unit: float | None = None) -> LentPiece | None:
        """A piece of ``seconds`` (steps of ``unit``), able to start at ``earliest``, queued on the lent device where
        it starts soonest, if that is before ``before`` (where it would start on its own device). None when none is."""
        with self._lock:
            best = min(((max(earliest, self._free_at[d]), d) for d in self._open), default=None)
            if best is None or best[0] >= before:
                return None
            start, device = best
            piece = LentPiece(device, start, seconds, unit)
            self._free_at[device] = piece.end
            queue = self._pieces.setdefault(device, [])
            queue[:] = [p for p in queue if p.end > earliest]  # those over before this one could start are done
            queue.append(piece)
            return piece

    @property
    def lent(self) -> list[str]:
        with self._lock:
            return sorted(self._open)
