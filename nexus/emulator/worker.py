"""The emulator's side of the seam on a worker: :class:`EmulatedDevices`, a model of the worker's devices
(:class:`nexus.wire.devices.DeviceModel`) whose work takes calibrated time, and the Dask preload that installs it
(``dask worker --preload nexus.emulator.worker``, after the service's own plugin; the settings are the file the
environment variable ``NEXUS_EMULATOR`` names, ``emulator.json`` in the service root).

A worker's devices: an actor rank's lanes (:class:`~nexus.emulator.actor.EmulatedActorHost`), an engine's
forwards (:class:`~nexus.emulator.engine.EmulatedEngine`), a simulator worker's lanes and the devices other services
lend it (:mod:`nexus.emulator.sim`, :class:`~nexus.emulator.lent.LentDevices`; the lenders reach them through the
four RPC handlers registered here: ``nexus_lend``, ``nexus_reclaim``, ``nexus_preempt``, and on an engine's
worker ``nexus_occupied``)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from nexus.emulator.lent import LentDevices
from nexus.emulator.settings import ENV, EmulationSettings
from nexus.wire import devices
from nexus.wire.engine_client import on_loop

logger = logging.getLogger("nexus.lender")

if TYPE_CHECKING:
    from nexus.config.service import ServiceConfig
    from nexus.emulator.cores import HostCores
    from nexus.emulator.engine import EmulatedEngine
    from nexus.emulator.lanes import Lanes
    from nexus.sim.host import SimHost
    from nexus.wire.messages import RolloutRequest, RolloutResult


class EmulatedDevices:
    """The worker's devices as the emulator's settings say (one per worker process)."""

    def __init__(self, settings: EmulationSettings, worker: Any | None = None) -> None:
        self.settings, self.worker = settings, worker
        # other services' devices lent to this worker's producers (lend_actor, ...)
        self.lent = LentDevices(contention=settings.lend_contention, on_take=self._tell_owner)
        self._lanes: tuple[Lanes, HostCores] | None = None  # a simulator worker's devices and cores (1st rollout)
        self._owners: dict[str, str] = {}  # a device an engine lends -> that engine's worker's address
        # an engine's device -> the end of the lent work placed on it (wall clock): what its forwards share it with
        self.occupied: dict[str, float] = {}
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

        return EmulatedEngine(config, self.settings, device, occupied=self.occupied)

    def run_rollout(self, sim: SimHost, req: RolloutRequest) -> RolloutResult:
        from nexus.emulator.sim import run_rollout, sim_lanes

        emu = self.settings
        with self._lock:
            if self._lanes is None:
                self._lanes = sim_lanes(emu)
        lanes, cores = self._lanes
        return run_rollout(sim, req, emu, lanes, self.lent if emu.lend_actor or emu.lend_inference else None, cores)

    # -- the lenders' messages (nexus.emulator.lender) ----------------------------------------------
    async def lend(self, devices: list[str], free_at: float) -> None:
        """An emulated actor rank lends ``devices`` to this worker's producers from ``free_at`` on."""
        self.lent.lend(devices, free_at)

    async def reclaim(self, devices: list[str], at: float) -> float:
        """... and takes them back at ``at`` (its devices' start; now at the latest): their pieces are cut at their
        next step from then. -> when the work on them ends (wall clock)."""
        return self.lent.reclaim(devices, at=min(at, time.time()))

    async def preempt(self, device: str, at: float, seconds: float, share: float, owner: str | None = None) -> None:
        """An emulated engine (on the worker at ``owner``) runs a forward on its lent ``device``
        (``LentDevices.preempt``: time-sliced with the lent work there)."""
        if owner:
            self._owners[device] = owner
        self.lent.preempt(device, at, seconds, share)

    async def occupy(self, device: str, until: float) -> None:
        """(On an engine's worker) lent work runs on ``device`` until ``until`` (wall clock): a forward meanwhile
        shares the device with it."""
        self.occupied[device] = max(self.occupied.get(device, 0.0), until)

    def _tell_owner(self, device: str, start: float, end: float) -> None:
        """A piece placed on an engine's lent ``device`` (a producer's thread): its engine hears of it, one way."""
        owner = self._owners.get(device)
        if owner is None or self.worker is None:
            return
        worker = self.worker

        async def tell() -> None:
            try:
                await worker.rpc(owner).nexus_occupied(device=device, until=end, reply=False)
            except OSError as e:  # the engine gone: its next forward is charged as unshared, nothing else lost
                logger.warning("nexus_occupied to %s failed: %s", owner, e)

        on_loop(worker, tell())


def install(settings: EmulationSettings, worker: Any | None = None) -> EmulatedDevices:
    """Model this process's devices with ``settings`` (and answer the lenders' messages on ``worker``)."""
    model = EmulatedDevices(settings, worker)
    devices.install(model)
    if worker is not None:
        worker.handlers.update({"nexus_lend": model.lend, "nexus_reclaim": model.reclaim,
                                "nexus_preempt": model.preempt, "nexus_occupied": model.occupy})
    return model


def dask_setup(worker: Any) -> None:
    """The preload: the settings from the file ``NEXUS_EMULATOR`` names."""
    path = os.environ.get(ENV)
    if not path:
        raise RuntimeError(f"nexus.emulator.worker: {ENV} names no settings file (start the service with "
                           "nexus.emulator.service)")
    install(EmulationSettings.read(path), worker)
