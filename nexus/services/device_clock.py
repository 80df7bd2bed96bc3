"""An emulated device's clock (``ServiceConfig.emulation``): it sleeps calibrated service times, less the host's
time owed from before — messaging, event-loop and timer lateness — which is the same milliseconds at any time
scale k and would otherwise grow k-fold in emulated seconds. Used by the emulated producer (synchronous steps)
and the emulated engine (forwards on its event loop)."""

from __future__ import annotations

import asyncio
import math
import time


class DeviceClock:
    """``cap``: the most host time ever owed (a stall of the host is not the device's to pay back)."""

    def __init__(self, cap: float = math.inf) -> None:
        self.cap = cap
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
        self.debt = min(self.debt + max(0.0, seconds), self.cap)

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

    async def spend_async(self, seconds: float) -> None:
        """:meth:`spend` on an event loop (the emulated engine's forwards)."""
        asked = self.ask(seconds)
        t0 = time.perf_counter()
        if asked > 0:
            await asyncio.sleep(asked)
        self.owe(time.perf_counter() - t0 - asked)
