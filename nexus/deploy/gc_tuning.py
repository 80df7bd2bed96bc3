"""The garbage collector of the processes on the predict path (the gateway, the inference engines' workers).

A full (generation 2) collection walks every tracked object of the process: a gateway or a Dask worker holds
several hundred thousand after start-up (modules, the app, Dask's state), so each one is a pause of tens of
ms in the middle of whichever predicts are running, a tail latency. :func:`apply` moves what exists after
start-up out of the collector's sight (``gc.freeze``: never collected, never walked again) and can raise the
young generation's threshold (fewer, larger collections of short-lived request objects), as
``gc.freeze`` / ``gc.gen0_threshold`` (``GcSettings``) say. :class:`GcPauses` counts the collections and their
time (``GET /v1/admin/qos``, the engine's stats) so the effect can be seen. Plain Python, no I/O.
"""

from __future__ import annotations

import gc
import time
from typing import Any

_FROZEN = False  # apply(freeze=True) ran in this process: refreeze() may freeze again


def apply(freeze: bool, gen0_threshold: int = 0) -> dict[str, Any]:
    """Freeze the objects alive now (after a full collection, so garbage is not kept forever) and set the
    generation-0 threshold (0: leave it). -> what was done, for the logs."""
    global _FROZEN
    if gen0_threshold > 0:
        _, g1, g2 = gc.get_threshold()
        gc.set_threshold(gen0_threshold, g1, g2)
    if freeze:
        gc.collect()
        gc.freeze()
        _FROZEN = True
    return {"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold()}


def refreeze() -> None:
    """Freeze again what a long-lived part built after start-up (an engine's backbone, built at its first sync),
    only in a process that :func:`apply` froze (never in a test's or a library user's own process)."""
    if _FROZEN:
        gc.collect()
        gc.freeze()


class GcPauses:
    """Collections of this process since :meth:`reset`, per generation: how many, their total and longest time."""

    def __init__(self) -> None:
        self.reset()
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def reset(self) -> None:
        self.count = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        g, dt = info["generation"], time.perf_counter() - self._t0
        self.count[g] += 1
        self.total_s[g] += dt
        self.max_s[g] = max(self.max_s[g], dt)

    def view(self) -> dict[str, Any]:
        return {"count": list(self.count), "total_ms": [round(1e3 * x, 2) for x in self.total_s],
                "max_ms": [round(1e3 * x, 2) for x in self.max_s], "frozen": gc.get_freeze_count(),
                "threshold": list(gc.get_threshold())}

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


_PAUSES: GcPauses | None = None


def pauses() -> GcPauses:
    """This process's one :class:`GcPauses` (created at the first call)."""
    global _PAUSES
    if _PAUSES is None:
        _PAUSES = GcPauses()
    return _PAUSES
