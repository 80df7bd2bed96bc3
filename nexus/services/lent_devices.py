"""Devices of another service lent to a simulator worker while their own service leaves them idle
(``EmulationSettings.lend_actor``): the emulated actor rank lends its devices when an update ends and takes them
back when the next one arrives. While lent, a producer whose own device is busy may run its next piece of device
work (a reset or an env step) on one of them; taken back, a device runs no new piece, and its owner starts its
own work once the piece already queued on it ends (:meth:`LentDevices.reclaim` says when).

Times are wall-clock seconds: the lender is another process on the same host."""

from __future__ import annotations

import threading


class LentDevices:
    def __init__(self) -> None:
        self._free_at: dict[str, float] = {}  # device -> end of the work queued on it (wall clock)
        self._open: set[str] = set()  # devices lent now
        self._lock = threading.Lock()

    def lend(self, devices: list[str], free_at: float) -> None:
        """``devices`` take pieces from ``free_at`` on (their owner's last work ends then)."""
        with self._lock:
            for d in devices:
                self._free_at[d] = max(self._free_at.get(d, 0.0), free_at)
                self._open.add(d)

    def reclaim(self, devices: list[str]) -> float:
        """Take ``devices`` back: no new piece starts on them. -> when the pieces queued on them end (wall clock;
        0 when none was ever queued)."""
        with self._lock:
            self._open.difference_update(devices)
            return max((self._free_at.get(d, 0.0) for d in devices), default=0.0)

    def take(self, earliest: float, seconds: float, before: float) -> tuple[str, float] | None:
        """A lent device on which a piece of ``seconds``, able to start at ``earliest``, starts before ``before``
        (where it would start on its own device): the earliest such start, queued there. None when none is."""
        with self._lock:
            best = min(((max(earliest, self._free_at[d]), d) for d in self._open), default=None)
            if best is None or best[0] >= before:
                return None
            start, device = best
            self._free_at[device] = start + seconds
            return device, start

    @property
    def lent(self) -> list[str]:
        with self._lock:
            return sorted(self._open)
