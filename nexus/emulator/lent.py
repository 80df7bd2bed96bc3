"""Devices of another service lent to a simulator worker while their own service leaves them idle
(``EmulationSettings.lend_actor``): the emulated actor rank lends its devices when an update ends and takes them
back at the next one's start on its devices' clock (its message arrives a host's dispatch later). While lent, a
producer whose own device is busy may run its next piece of device work (a reset, or the env steps of an action
chunk) on one of them, as one :class:`DevicePiece`. Taken back, a device starts no new step: a piece running on it is
cut at its next step boundary (its producer, woken, does the rest on its own device), steps that began after the
take-back while the message travelled are revoked (their producer runs them again on its own device), and its
owner starts its own work when the last step begun before ends (:meth:`LentDevices.reclaim` says when). A piece is
one sleep of its producer however many steps it holds, so lending costs the host no more per step than stepping on
its own device.

An emulated inference engine lends its device for good instead (``EmulationSettings.lend_inference``) and tells
the simulator workers of each forward (:meth:`LentDevices.preempt`). The engine and the simulator are two processes:
without MPS a GPU time-slices them, so while the forward and a lent piece share the device both progress
``contention`` times slower (the piece running then is pushed back by ``(contention - 1)`` times the seconds they
share, those queued after it with it); a piece that arrives during a forward queues behind it. The engine hears
of the lent work on its device (``on_take``) and charges its forward the same slowdown. A producer takes such a
device only when its piece ends sooner there at the share of the device its owner leaves (the owner says what share
it uses).

A piece placed on a device other than the one holding its producer's envs' state (``state_on``) first moves the
state there, ``move_s`` (its ``lead``).

Times are wall-clock seconds: the lender is another process on the same host."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from nexus.emulator.piece import DevicePiece

RECLAIM_LATE_S = 2.0  # how far back a reclaim may cut the pieces on a device (they are kept that long after their end)


class LentDevices:
    def __init__(self, now: Callable[[], float] = time.time, contention: float = 2.0,
                 on_take: Callable[[str, float, float], None] | None = None) -> None:
        """``contention``: how many times slower a forward and a lent piece progress while they share a device
        (``EmulationSettings.lend_contention``); ``on_take(device, start, end)``: told of each piece placed on a
        device an engine lends (for the engine to charge its forwards the sharing)."""
        self.now = now  # the wall clock (a test's own keeps the devices' clock exact)
        self.contention, self.on_take = contention, on_take
        self._free_at: dict[str, float] = {}  # device -> end of the work queued on it (wall clock)
        self._pieces: dict[str, list[DevicePiece]] = {}  # device -> its pieces not over (or lately: RECLAIM_LATE_S)
        self._open: set[str] = set()  # devices lent now
        # device -> since when it is lent on the devices' clock (its lend said then: a piece made before, on that
        # clock, was placed where it could go then, even if its producer's host reaches here later)
        self._lent_at: dict[str, float] = {}
        self._owner_share: dict[str, float] = {}  # device -> the share of its time its owner's own work takes
        self._lock = threading.Lock()

    def lend(self, devices: list[str], free_at: float) -> None:
        """``devices`` take pieces from ``free_at`` on (their owner's last work ends then)."""
        with self._lock:
            for d in devices:
                self._free_at[d] = max(self._free_at.get(d, 0.0), free_at)
                if d not in self._open:
                    self._lent_at[d] = min(free_at, self.now())
                self._open.add(d)

    def reclaim(self, devices: list[str], at: float) -> float:
        """Take ``devices`` back at ``at`` (wall clock, never in the future): no new piece starts on them and the
        pieces queued on them are cut at their next step boundary from ``at`` (:meth:`DevicePiece.cut`: steps run
        since are revoked). -> when those end (0 when none was ever queued)."""
        with self._lock:
            self._open.difference_update(devices)
            for d in devices:
                pieces = self._pieces.pop(d, [])
                for piece in pieces:
                    piece.cut(at)
                if pieces:  # the last piece that runs a step ends the device's work; else its work before them did,
                    # by ``at`` (so its owner starts then, not at the start of a piece revoked: it never runs there)
                    ran = [p.end for p in pieces if p.ran > 0]
                    self._free_at[d] = max(ran) if ran else min(pieces[0].start, at)
            return max((self._free_at.get(d, 0.0) for d in devices), default=0.0)

    def preempt(self, device: str, at: float, seconds: float, share: float = 0.0) -> float:
        """``device``'s owner runs ``seconds`` of its own work (alone on the device) from ``at`` (wall clock), and
        lends the device otherwise (from now on, if it was not lent yet). The two are time-sliced: while the work
        and lent pieces run together both progress ``contention`` times slower, so each piece it meets is pushed
        back by ``(contention - 1)`` times the seconds they share, and the pieces queued after by as much as they
        need; ``share``: the part of the device's time the owner's work takes lately (what a new piece expects to
        lose to it). -> the work's end."""
        c = self.contention
        with self._lock:
            if device not in self._open:
                self._lent_at[device] = min(at + seconds, self.now())
            self._open.add(device)
            self._owner_share[device] = min(max(share, 0.0), 0.95)
            t, left, busy_until = at, seconds, 0.0  # the owner's work: now at t, ``left`` of it to run
            for piece in sorted(self._pieces.get(device, []), key=lambda p: p.start):
                if piece.end <= at:
                    continue
                if piece.begins < busy_until:  # queued behind the pieces before it, pushed back with them
                    piece.push(busy_until - piece.begins)
                if left > 0 and piece.begins > t:  # the owner's work alone until this piece begins
                    alone = min(left, piece.begins - t)
                    t, left = t + alone, left - alone
                if left > 0 and piece.begins <= t < piece.end:  # together: each at 1/c of the device
                    together = min(left, piece.end - t)  # the seconds of each's own work done side by side
                    piece.push((c - 1.0) * together)
                    t, left = t + c * together, left - together
                busy_until = max(busy_until, piece.end)
            end = t + left
            self._free_at[device] = max(self._free_at.get(device, 0.0), end, busy_until)
            return end

    def take(self, earliest: float, seconds: float, before: float, unit: float | None = None, move_s: float = 0.0,
             state_on: str | None = None) -> DevicePiece | None:
        """A piece of ``seconds`` (steps of ``unit``), able to start at ``earliest`` (made then on the devices' clock:
        only a device lent by then takes it), queued on the lent device where it is expected to end soonest (at the
        share of the device its owner leaves), the move of its producer's state there included (``move_s`` on any
        device but ``state_on``), if that is sooner than on its own device, where it would start at ``before``.
        None when none is."""
        def cost(d: str) -> float:
            return (0.0 if d == state_on else move_s) + seconds

        with self._lock:
            best = min(((max(earliest, self._free_at[d]) + cost(d) / (1.0 - self._owner_share.get(d, 0.0)), d)
                        for d in self._open if earliest >= self._lent_at[d]), default=None)
            if best is None or best[0] >= before + seconds:
                return None
            start, device = max(earliest, self._free_at[best[1]]), best[1]
            piece = DevicePiece(device, start, cost(device), unit, lead=cost(device) - seconds)
            self._free_at[device] = piece.end
            queue = self._pieces.setdefault(device, [])
            # those over before this one could start are done; on a device its owner takes back, kept a while: the
            # reclaim reaches here a host's dispatch after its devices' start (it cuts those after: DevicePiece.cut)
            kept = 0.0 if device in self._owner_share else RECLAIM_LATE_S  # an engine's device is lent for good
            queue[:] = [p for p in queue if p.end > earliest - kept]
            queue.append(piece)
        if self.on_take is not None and device in self._owner_share:  # an engine's: it charges the sharing
            self.on_take(device, piece.start, piece.end)
        return piece

    @property
    def lent(self) -> list[str]:
        with self._lock:
            return sorted(self._open)
