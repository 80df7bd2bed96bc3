"""The lending side of ``EmulationSettings.lend_actor`` and ``lend_inference``: the emulated actor rank lends its idle
devices to the simulator workers (their :class:`~nexus.emulator.lent.LentDevices`) and takes them back; an
emulated engine tells them of each forward it runs first on its lent device. Worker to worker over Dask's RPC (the
scheduler is asked once where the simulator workers are, and again when one is gone)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from distributed import get_worker

from nexus.wire.engine_client import on_loop

logger = logging.getLogger("nexus.lender")
CALL_TIMEOUT_S = 5.0


class DeviceLender:
    def __init__(self) -> None:
        self._sims: list[str] | None = None  # simulator workers' addresses

    def lend(self, devices: list[str], free_at: float) -> None:
        """``devices`` are idle from ``free_at`` (wall clock) on."""
        self._call("nexus_lend", devices=devices, free_at=free_at)

    def reclaim(self, devices: list[str], at: float) -> float:
        """Take ``devices`` back at ``at``: their next work's start on their own clock (wall clock), which this call
        reaches later, by the host's dispatch of that work. -> when the simulator work queued on them ends (wall
        clock; 0: none)."""
        return max((float(r) for r in self._call("nexus_reclaim", devices=devices, at=at) if r), default=0.0)

    async def preempt(self, worker: Any, device: str, at: float, seconds: float, share: float) -> None:
        """From an event loop (an engine's): ``device`` runs ``seconds`` of its own work from ``at`` (wall clock)
        first, and is lent otherwise; ``share``: the part of its time that work takes lately. One way: sent, not
        answered (one notice per forward, as many as the action requests: a reply each cost both workers' event
        loops a message for nothing). The simulator workers tell ``worker`` (its address: ``owner``) of the lent
        work they place on the device (``nexus_occupied``)."""
        try:
            await self._all(worker, "nexus_preempt", {"device": device, "at": at, "seconds": seconds, "share": share,
                                                      "owner": worker.address}, reply=False)
        except (TimeoutError, OSError) as e:
            logger.warning("nexus_preempt: the scheduler did not answer: %s", e)
            self._sims = None

    def _call(self, op: str, **msg: Any) -> list[Any]:
        """``op`` on every simulator worker: their answers. One that cannot be reached is skipped (a lend it misses
        only leaves a device idle; a restarted worker queued nothing on it)."""
        worker = get_worker()
        try:
            return on_loop(worker, self._all(worker, op, msg)).result(CALL_TIMEOUT_S * 2)
        except (TimeoutError, OSError) as e:
            logger.warning("%s: the scheduler or a simulator worker did not answer: %s", op, e)
            self._sims = None
            return []

    async def _all(self, worker: Any, op: str, msg: dict[str, Any], reply: bool = True) -> list[Any]:
        if self._sims is None:
            ident = await asyncio.wait_for(worker.scheduler.identity(), CALL_TIMEOUT_S)
            self._sims = [a for a, w in ident.get("workers", {}).items() if "SIM" in (w.get("resources") or {})]
        out = []
        for addr in self._sims:
            try:
                out.append(await asyncio.wait_for(getattr(worker.rpc(addr), op)(**msg, reply=reply), CALL_TIMEOUT_S))
            except (TimeoutError, OSError) as e:  # gone or restarting: asked again next time
                logger.warning("%s to simulator worker %s failed: %s", op, addr, e)
                self._sims = None
        return out
