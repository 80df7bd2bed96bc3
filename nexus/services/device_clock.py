"""An emulated producer's clock (``ServiceConfig.emulation``): it sleeps calibrated service times, less the host's
time owed from before — messaging, event-loop and timer lateness. Those are the same milliseconds at any time
scale k, so k-fold in emulated seconds: of each, the devices' clock keeps the share a run at the devices' real
speed would see (1/k: all of it at k = 1, where emulated and host seconds are one) and the producer owes the rest.
(The emulated engine and actor keep their devices' :class:`DeviceTimeline` instead, with the same rule.)"""

from __future__ import annotations

import time


def host_share(late: float, k: float) -> float:
    """Of ``late`` seconds of host time, what a run at the devices' real speed would see of it: 1/k."""
    return max(0.0, late) / max(k, 1.0)


class DeviceClock:
    """``k``: the time scale (host time beyond the devices' is owed less its share :func:`host_share`)."""

    def __init__(self, k: float = 1.0) -> None:
        self.k = k
        self.debt = 0.0  # host time not yet taken off a later sleep
        self.slept = 0.0  # calibrated time spent, whatever was actually slept
        self.queued = 0.0  # time waited for a device shared with other work

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

    def spend(self, seconds: float, queued: float = 0.0) -> None:
        """Sleep ``seconds`` of device time in this thread, after ``queued`` seconds waiting for a shared device
        (``Lanes.occupy``, counted from the arrival the debt puts earlier: so the debt is paid out of the wait
        first); the timer's lateness is owed too."""
        self.queued += queued
        asked = self._pay(queued) + self.ask(seconds)
        if asked > 0:
            t0 = time.perf_counter()
            time.sleep(asked)
            self.owe(time.perf_counter() - t0 - asked)


class DeviceTimeline:
    """``n`` devices' own clock (the caller's time base: monotonic or wall seconds), for work that sleeps to its end
    on it (the emulated engine's forwards, the actor's updates): a piece starts when it was ready or when its devices
    ended their work before, whichever is later, plus the share of the host's lateness since that a run at the
    devices' speed would see (:func:`host_share`)."""

    def __init__(self, n: int, k: float = 1.0) -> None:
        self.k = k  # the time scale
        self.free_at = [0.0] * n  # each device's end of its last piece of work

    def start(self, lanes: list[int], ready: float, now: float) -> float:
        """The start on ``lanes`` of a piece ready at ``ready`` (never after ``now``)."""
        base = max(min(ready, now), *(self.free_at[i] for i in lanes))
        return base + host_share(now - base, self.k)

    def end(self, lanes: list[int], t: float) -> None:
        for i in lanes:
            self.free_at[i] = t
