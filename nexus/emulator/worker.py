"""The emulator's side of the seam on a worker: :class:`EmulatedDevices`, a model of the worker's devices
(:class:`nexus.wire.devices.DeviceModel`) whose work takes calibrated time, and the Dask preload that installs it
(``dask worker --preload nexus.emulator.worker``, after the service's own plugin; the settings are the file the
environment variable ``NEXUS_EMULATOR`` names, ``emulator.json`` in the service root).

A worker's devices: an actor rank's lanes (:class:`~nexus.emulator.actor.EmulatedActorHost`), an engine's
forwards (:class:`~nexus.emulator.engine.EmulatedEngine`), a simulator worker's lanes and the devices other services
lend it (:mod:`nexus.emulator.sim`, :class:`~nexus.emulator.lent.LentDevices`; the lenders reach them through the
three RPC handlers registered here: ``nexus_lend``, ``nexus_reclaim``, ``nexus_preempt``)."""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any

from nexus.emulator.lent import LentDevices
from nexus.emulator.settings import ENV, EmulationSettings
from nexus.wire import devices

if TYPE_CHECKING:
    from nexus.config.service import ServiceConfig
    from nexus.emulator.engine import EmulatedEngine
    from nexus.emulator.lanes import Lanes
    from nexus.sim.host import SimHost
    from nexus.wire.messages import RolloutRequest, RolloutResult


class EmulatedDevices:
    """The worker's devices as the emulator's settings say (one per worker process)."""

    def __init__(self, settings: EmulationSettings) -> None:
        self.settings = settings
        self.lent = LentDevices()  # other services' devices lent to this worker's producers (lend_actor, ...)
        self._lanes: Lanes | None = None  # a simulator worker's devices, made at its first rollout
        self._lock = threading.Lock()

    # -- the seam (nexus.wire.devices.DeviceModel) ---------------------------------------------
    # each role's module is imported when the worker first hosts the role (as the service's own roles are): the
    # preload stays light on every worker, the tracker's too
    def actor_host(self, config: ServiceConfig, rank: int, world_size: int, current: Any | None) -> Any | None:
        from nexus.emulator.actor import EmulatedActorHost

        if isinstance(current, EmulatedActorHost) and (current.rank, current.world_size) == (rank, world_size):
            return current  # its slots stay
        return EmulatedActorHost(config, self.settings, rank, world_size)

    def engine(self, config: ServiceConfig, device: str | None) -> EmulatedEngine:
        from nexus.emulator.engine import EmulatedEngine

        return EmulatedEngine(config, self.settings, device)

    def run_rollout(self, sim: SimHost, req: RolloutRequest) -> RolloutResult:
        from nexus.emulator.sim import run_rollout, sim_lanes

        emu = self.settings
        with self._lock:
            if self._lanes is None:
                self._lanes = sim_lanes(emu)
        return run_rollout(sim, req, emu, self._lanes, self.lent if emu.lend_actor or emu.lend_inference else None)

    # -- the lenders' messages (nexus.emulator.lender) ----------------------------------------------
    async def lend(self, devices: list[str], free_at: float) -> None:
        """An emulated actor rank lends ``devices`` to this worker's producers from ``free_at`` on."""
        self.lent.lend(devices, free_at)

    async def reclaim(self, devices: list[str], at: float) -> float:
        """... and takes them back at ``at`` (its devices' start; now at the latest): their pieces are cut at their
        next step from then. -> when the work on them ends (wall clock)."""
        return self.lent.reclaim(devices, at=min(at, time.time()))

    async def preempt(self, device: str, at: float, seconds: float, share: float) -> None:
        """An emulated engine runs a forward on its lent ``device`` first (``LentDevices.preempt``)."""
        self.lent.preempt(device, at, seconds, share)


def install(settings: EmulationSettings, worker: Any | None = None) -> EmulatedDevices:
    """Model this process's devices with ``settings`` (and answer the lenders' messages on ``worker``)."""
    model = EmulatedDevices(settings)
    devices.install(model)
    if worker is not None:
        worker.handlers.update({"nexus_lend": model.lend, "nexus_reclaim": model.reclaim,
                                "nexus_preempt": model.preempt})
    return model


def dask_setup(worker: Any) -> None:
    """The preload: the settings from the file ``NEXUS_EMULATOR`` names."""
    path = os.environ.get(ENV)
    if not path:
        raise RuntimeError(f"nexus.emulator.worker: {ENV} names no settings file (start the service with "
                           "nexus.emulator.service)")
    install(EmulationSettings.read(path), worker)
