"""The switch: an emulated local service. The service's own settings (``ServiceConfig``) stay as they are; the
emulator's (:class:`~nexus.emulator.settings.EmulationSettings`) go to ``emulator.json`` in the service root, and
every worker preloads :mod:`nexus.emulator.worker`, which installs the emulated devices in the service's one seam
(:mod:`nexus.wire.devices`). One worker per service holds all its devices (its Dask resource count and threads,
and the ``DEVICES`` each is charged as)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from nexus.client.api import Nexus
from nexus.config.service import ServiceConfig
from nexus.deploy.local import LocalService
from nexus.emulator.settings import ENV, FILE, EmulationSettings
from nexus.errors import SpecError, describe_errors


def settings_of(emulation: EmulationSettings | dict[str, Any]) -> EmulationSettings:
    """The emulator's settings; bad ones are a :class:`SpecError` naming the setting."""
    if isinstance(emulation, EmulationSettings):
        return emulation
    try:
        return EmulationSettings.model_validate(emulation)
    except ValidationError as e:
        raise SpecError(f"emulator settings: {describe_errors(e.errors(), root='?', field_words=True)}") from None


def configure(config: ServiceConfig, emu: EmulationSettings) -> ServiceConfig:
    """The service's settings an emulated service needs: one actor rank (its worker holds ``devices.actor``
    devices), an engine per inference device, and the tracker on a worker of its own unless said otherwise (its
    host time would otherwise land on the emulated devices' workers)."""
    if config.actor_ranks != 1:
        raise SpecError(f"an emulated service has one actor rank (its worker holds devices.actor = "
                        f"{emu.devices.actor} devices), got actor_ranks = {config.actor_ranks}")
    if "inference_engines" in config.model_fields_set and config.inference_engines != emu.devices.inference:
        raise SpecError(f"inference_engines {config.inference_engines} differs from the emulated devices.inference "
                        f"{emu.devices.inference}")
    cluster = config.cluster
    if cluster.tracker_worker is None:
        cluster = cluster.model_copy(update={"tracker_worker": True})
    return config.model_copy(update={"inference_engines": emu.devices.inference, "cluster": cluster})


class EmulatedLocalService(LocalService):
    """A :class:`LocalService` whose workers model their devices with ``emu``."""

    def __init__(self, config: ServiceConfig, emu: EmulationSettings, **kwargs: Any) -> None:
        d = emu.devices
        config = configure(config, emu)
        settings_path = Path(config.root).resolve() / FILE
        super().__init__(config, n_sim=1, n_infer=1,
                         slots={"sim": emu.sim_places, "actor": d.actor, "infer": d.inference},
                         devices={"sim": d.simulator, "actor": d.actor, "infer": d.inference},
                         env={ENV: str(settings_path)}, preload=("nexus.emulator.worker",), **kwargs)
        self.emulation = emu
        self.settings_path = settings_path

    def start(self, timeout: float = 600) -> LocalService:
        """As :meth:`LocalService.start`, with longer to come up: benchmarks start emulated services on shared hosts
        whose load can keep a process's imports past the real service's 2 minutes."""
        return super().start(timeout)

    def _start(self, timeout: float) -> LocalService:
        self.emulation.save(self.settings_path)  # in the root, which start() made and locked
        return super()._start(timeout)


def local(root: Any = None, emulation: EmulationSettings | dict[str, Any] | None = None,
          dashboard_address: str | None = None, **kwargs: Any) -> Nexus:
    """``Nexus.local`` on emulated devices: ``emulation``, the emulator's settings; the rest as ``Nexus.local``'s
    (``config``, ``overrides`` and ``ServiceConfig`` fields)."""
    if emulation is None:
        raise SpecError("an emulated service needs the emulator's settings (a calibration at least)")
    emu = settings_of(emulation)
    return Nexus.local(root, service=lambda cfg: EmulatedLocalService(cfg, emu, dashboard_address=dashboard_address),
                       **kwargs)
