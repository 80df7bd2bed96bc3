"""Devices of another service lent to a simulator worker while their own service leaves them idle
(``EmulationSettings.lend_actor``): the emulated actor rank lends its devices when an update ends and takes them
back at the next one's start on its devices' clock (its message arrives a host's dispatch later). While lent, a
producer whose own device is busy may run its next piece of device work (a reset, or the env steps of an action
chunk) on one of them, as one :class:`LentPiece`. Taken back, a device starts no new step: a piece running on it is
cut at its next step boundary (its producer, woken, does the rest on its own device), steps that began after the
take-back while the message travelled are revoked (their producer runs them again on its own device), and its
owner starts its own work when the last step begun before ends (:meth:`LentDevices.reclaim` says when). A piece is
one sleep of its producer however many steps it holds, so lending costs the host no more per step than stepping on
its own device.

An emulated inference engine lends its device for good instead (``EmulationSettings.lend_inference``) and runs
each forward on it *first* (:meth:`LentDevices.preempt`: a GPU running a forward on a high-priority stream beside a
simulator's kernels): the forward never waits, and the pieces running or queued there are pushed back by it. A
producer then takes such a device only when its piece ends sooner there at the share of the device its owner
leaves (the owner says what share it uses).

Times are wall-clock seconds: the lender is another process on the same host."""

from __future__ import annotations

import math
import threading
import time

RECLAIM_LATE_S = 2.0  # how far back a reclaim may cut the pieces on a device (they are kept that long after their end)


class LentPiece:
    """``seconds`` of device work queued on lent ``device`` from ``start``, in steps of ``unit`` seconds."""

    def __init__(self, device: str, start: float, seconds: float, unit: float | None = None) -> None:
        self.device, self.start, self.seconds = device, start, seconds
        self.unit = unit if unit and unit > 0 else seconds
        self.ran = seconds  # the device seconds it runs: all of them unless it is cut
        self.pushed = 0.0  # seconds its owner's own work (forwards run first) pushed it back
        self.missed = 0.0  # ... and what would have pushed it, heard of after its producer went on (too late)
        self.revoked = 0.0  # steps that ran after its owner took the device back, heard of after its producer went on
        self._changed = threading.Condition()
        self._cut = False
        self._settled = False  # its producer has read how much ran and how long it was pushed: final

    @property
    def end(self) -> float:
        return self.start + self.pushed + self.ran

    def cut(self, at: float) -> float:
        """No step of the piece begins after ``at``: it ends at the first step boundary from ``at`` on (its start
        when it had not begun). A piece whose producer went on already ran those steps: they are :attr:`revoked`,
        for its producer to run again on its own device (``at`` may be past: the owner's start on its devices'
        clock, which its message reaches a host's dispatch later). -> its end."""
        with self._changed:
            if at < self.end:
                steps = max(0, math.ceil((at - self.start - self.pushed) / self.unit - 1e-9))
                kept = min(self.ran, steps * self.unit)
                if self._settled:
                    self.revoked += self.ran - kept
                else:
                    self._cut = True
                    self._changed.notify_all()
                self.ran = kept
            return self.end

    def take_revoked(self) -> float:
        """The device seconds revoked since last asked (:meth:`cut`)."""
        with self._changed:
            out, self.revoked = self.revoked, 0.0
            return out

    def push(self, seconds: float) -> None:
        """The device's owner ran ``seconds`` of its own work first: the piece ends that much later (a piece whose
        producer has gone on is not pushed: the push is counted as ``missed``, what the emulation got for free)."""
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


class LentDevices:
    def __init__(self) -> None:
        self._free_at: dict[str, float] = {}  # device -> end of the work queued on it (wall clock)
        self._pieces: dict[str, list[LentPiece]] = {}  # device -> its pieces not over (or lately: RECLAIM_LATE_S)
        self._open: set[str] = set()  # devices lent now
        self._owner_share: dict[str, float] = {}  # device -> the share of its time its owner's own work takes
        self._lock = threading.Lock()

    def lend(self, devices: list[str], free_at: float) -> None:
        """``devices`` take pieces from ``free_at`` on (their owner's last work ends then)."""
        with self._lock:
            for d in devices:
                self._free_at[d] = max(self._free_at.get(d, 0.0), free_at)
                self._open.add(d)

    def reclaim(self, devices: list[str], at: float) -> float:
        """Take ``devices`` back at ``at`` (wall clock, never in the future): no new piece starts on them and the
        pieces queued on them are cut at their next step boundary from ``at`` (:meth:`LentPiece.cut`: steps run
        since are revoked). -> when those end (0 when none was ever queued)."""
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

    def preempt(self, device: str, at: float, seconds: float, share: float = 0.0) -> None:
        """``device``'s owner runs ``seconds`` of its own work from ``at`` (wall clock) ahead of the pieces there,
        and lends the device otherwise (from now on, if it was not lent yet). The piece running at ``at`` and those
        queued after it are pushed back as far as the work needs; ``share``: the part of the device's time the
        owner's work takes lately (what a new piece expects to lose to it)."""
        with self._lock:
            self._open.add(device)
            self._owner_share[device] = min(max(share, 0.0), 0.95)
            busy_until = at + seconds
            for piece in sorted(self._pieces.get(device, []), key=lambda p: p.start):
                if piece.end <= at:
                    continue
                piece.push(seconds if piece.start + piece.pushed < at else busy_until - piece.start - piece.pushed)
                busy_until = max(busy_until, piece.end)
            self._free_at[device] = max(self._free_at.get(device, 0.0), busy_until)

    def take(self, earliest: float, seconds: float, before: float, unit: float | None = None) -> LentPiece | None:
        """A piece of ``seconds`` (steps of ``unit``), able to start at ``earliest``, queued on the lent device where
        it is expected to end soonest (at the share of the device its owner leaves), if that is sooner than on its
        own device, where it would start at ``before``. None when none is."""
        with self._lock:
            best = min(((max(earliest, self._free_at[d]) + seconds / (1.0 - self._owner_share.get(d, 0.0)), d)
                        for d in self._open), default=None)
            if best is None or best[0] >= before + seconds:
                return None
            start, device = max(earliest, self._free_at[best[1]]), best[1]
            piece = LentPiece(device, start, seconds, unit)
            self._free_at[device] = piece.end
            queue = self._pieces.setdefault(device, [])
            # those over before this one could start are done; on a device its owner takes back, kept a while: the
            # reclaim reaches here a host's dispatch after its devices' start (it cuts those after: LentPiece.cut)
            kept = 0.0 if device in self._owner_share else RECLAIM_LATE_S  # an engine's device is lent for good
            queue[:] = [p for p in queue if p.end > earliest - kept]
            queue.append(piece)
            return piece

    @property
    def lent(self) -> list[str]:
        with self._lock:
            return sorted(self._open)
