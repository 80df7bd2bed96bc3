"""An emulated producer's clock (:mod:`nexus.emulator`): it sleeps calibrated service times, less the host's
time owed from before — messaging, event-loop and timer lateness. Those are the same milliseconds at any time
scale k, so k-fold in emulated seconds: of each, the devices' clock keeps the share a run at the devices' real
speed would see (1/k: all of it at k = 1, where emulated and host seconds are one) and the producer owes the rest.
(The emulated engine and actor keep their devices' :class:`DeviceTimeline` instead, with the same rule.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from nexus.emulator.host import spend_cpu


def host_share(late: float, k: float) -> float:
    """Of ``late`` seconds of host time, what a run at the devices' real speed would see of it: 1/k."""
    return max(0.0, late) / max(k, 1.0)


class DeviceClock:
    """``k``: the time scale (host time beyond the devices' is owed less its share :func:`host_share`). Every host
    second from the clock's start is either a device's — slept for device work (:meth:`spend`) or another device's
    work waited for (``served`` of a :meth:`message`) — or owed: a message's own time, the timer's lateness, and the
    caller's loop between them (:meth:`settle`; its locks and its share of the process's interpreter, which grow with
    the host's load, not with k)."""

    def __init__(self, k: float = 1.0, now: Callable[[], float] = time.perf_counter) -> None:
        self.k, self.now = k, now  # ``now``: the host's clock (a test's own keeps the accounting exact)
        self.debt = 0.0  # host time not yet taken off a later sleep
        self.slept = 0.0  # calibrated time spent, whatever was actually slept
        self.queued = 0.0  # time waited for a device shared with other work
        self._mark = now()  # host time up to here is accounted for
        self._accounted = 0.0  # host time since the mark accounted for already (messages)

    def ask(self, seconds: float) -> float:
        """What to sleep for ``seconds`` of device time: the owed host time is paid out of it first."""
        self.slept += seconds
        return self._pay(seconds)

    def _pay(self, seconds: float) -> float:
        pay = min(self.debt, seconds)
        self.debt -= pay
        return seconds - pay

    def owe(self, seconds: float) -> None:
        self.debt += max(0.0, seconds) - host_share(seconds, self.k)

    def message(self, took: float, served: float, paid: float = 0.0) -> None:
        """A round trip of ``took`` host seconds, ``served`` of them another device's work waited for (an engine's
        queue and forward, on its own clock): the rest is the host's messaging, owed. ``paid``: the part of
        ``served`` before the request reached the engine (it was made that much earlier on the devices' clock: the
        debt it carried, the request's ``lead_s``): device time the debt stood for, so paid off it."""
        paid = min(max(0.0, paid), self.debt)
        self.debt -= paid
        self.owe(took - served + paid)
        self._accounted += max(0.0, took)

    def settle(self) -> None:
        """Owe the host time since the last accounted moment that no message accounted for: the caller's own loop."""
        now = self.now()
        self.owe(now - self._mark - self._accounted)
        self._mark, self._accounted = now, 0.0

    def revoke(self, seconds: float) -> None:
        """``seconds`` of device work slept on a lent device that, on the devices' clock, its owner had taken back
        already (``DevicePiece.revoked``): not spent — they are run again — and the time slept for them is owed."""
        self.slept -= seconds
        self.debt += seconds

    def spend_on_host(self, seconds: float, device: threading.Lock,
                      spend: Callable[[float], object] = spend_cpu) -> float:
        """``seconds`` of device work spent as CPU on the host's cores (``device_work = "host_cpu"``), one piece at a
        time on ``device`` (the wait for it is ``queued``; ``spend``: what spends it, :func:`spend_cpu`): the host time
        it takes, whatever the other work on the cores made it, is what is spent. -> that."""
        self.settle()
        t0 = self.now()
        with device:
            t1 = self.now()
            spend(seconds)
            took = self.now() - t1
        self.queued += t1 - t0
        self.slept += took
        self.settle()
        return took

    def spend(self, seconds: float, queued: float = 0.0,
              cut: Callable[[float], tuple[float, float]] | None = None) -> float:
        """Sleep ``seconds`` of device time in this thread, after ``queued`` seconds waiting for a shared device
        (``Lanes.place``, counted from the arrival the debt puts earlier: so the debt is paid out of the wait
        first); the timer's lateness is owed too. ``cut``: the piece may be cut short or pushed back while it runs
        (on a lent device: taken back, or its owner's work run first; on its own, pushed back by pieces that came
        earlier on the devices' clock; ``DevicePiece.wait_cut``): it waits the sleep's length plus the pushes and
        answers the seconds cut off the piece's end and those it was pushed back (waited for the device, as
        ``queued``). -> the device seconds spent."""
        self.settle()
        self.queued += queued
        wait = self._pay(queued)
        work = self.ask(seconds)
        t0 = self._mark
        off, pushed = cut(wait + work) if cut is not None else (0.0, 0.0)
        if off > 0:  # the steps not run are neither slept nor spent; the debt they paid is owed again
            self.slept -= off
            self.debt += max(0.0, off - work)
            work = max(0.0, work - off)
        self.queued += pushed
        asked = wait + work + pushed
        left = asked - (self.now() - t0)
        if left > 0:
            time.sleep(left)
        end = self.now()
        if asked > 0 or cut is not None:
            self.owe(end - t0 - asked)
            self._mark = end
        return seconds - off


class DeviceTimeline:
    """``n`` devices' own clock (the caller's time base: monotonic or wall seconds), for work that sleeps to its end
    on it (the emulated engine's forwards, the actor's updates): a piece starts when it was ready or when its devices
    ended their work before, whichever is later, plus the share of the host's lateness since that a run at the
    devices' speed would see (:func:`host_share`)."""

    def __init__(self, n: int, k: float = 1.0) -> None:
        self.k = k  # the time scale
        self.free_at = [0.0] * n  # each device's end of its last piece of work

    def start(self, lanes: list[int], ready: float, now: float, late_from: float | None = None) -> float:
        """The start on ``lanes`` of a piece ready at ``ready`` (never after ``now``). ``late_from``: when the host had
        it ready, when that is later (its requests' host time before is owed by their producers): the host's
        lateness is counted from there."""
        base = max(min(ready, now), *(self.free_at[i] for i in lanes))
        return base + host_share(now - max(base, late_from or base), self.k)

    def end(self, lanes: list[int], t: float) -> None:
        for i in lanes:
            self.free_at[i] = t
