"""The one seam between a worker and the time its device work takes: a :class:`DeviceModel`.

A worker's device work is an actor update, an inference forward, a simulator rollout. By default it runs on the
real devices and takes its own time (:class:`RealDevices`: every hook answers None, "the real work"). A model of the
devices may be installed in the worker process instead (:func:`install`, e.g. from a Dask ``--preload``): it hosts
the actor rank, builds the engine and runs the rollout, taking what time it says; everything around them — the
worker plugin, the engine's queue and batching, the control plane's tasks, messages and accounting — stays the
same code. Timing facts the control plane passes along (a batch's or an update's end, a request's lead) are
generic stamps the real devices leave at 0 ("not said").

A worker may hold several devices of its role (its Dask resource ``DEVICES``, default 1): each is a slot of the
service's accounting, named :func:`slot_label`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from nexus.deploy.processes import DEVICES_RESOURCE

if TYPE_CHECKING:
    from nexus.config.service import ServiceConfig
    from nexus.wire.messages import RolloutRequest, RolloutResult

# the engine a model builds and the simulator host it runs rollouts on are the worker side's own types
# (``nexus.engine.engine.InferenceEngine``, ``nexus.sim.host.SimHost``): named, not imported, so the
# seam stays below the roles that call it
InferenceEngine = Any
SimHost = Any


class DeviceModel(Protocol):
    """Where a worker's device work takes its time. Each hook answers None for the real work."""

    def actor_host(self, config: ServiceConfig, rank: int, world_size: int, current: Any | None) -> Any | None:
        """The actor rank this worker hosts (with the tasks it runs itself: its ``tasks``; ``current``: the one it
        hosts now, kept when it fits, its slots with it), or None: the real one."""

    def engine(self, config: ServiceConfig, device: str | None) -> InferenceEngine | None:
        """An inference engine charged to ``device`` (its slot), or None: the real one."""

    def run_rollout(self, sim: SimHost, req: RolloutRequest) -> RolloutResult | None:
        """A rollout producer's task, or None: the real producer."""


class RealDevices:
    """The real devices: the work takes its own time."""

    def actor_host(self, config: ServiceConfig, rank: int, world_size: int, current: Any | None) -> Any | None:
        return None

    def engine(self, config: ServiceConfig, device: str | None) -> InferenceEngine | None:
        return None

    def run_rollout(self, sim: SimHost, req: RolloutRequest) -> RolloutResult | None:
        return None


_model: DeviceModel = RealDevices()


def install(model: DeviceModel) -> None:
    """Put ``model`` in place of the real devices for this process's device work (before any of it starts)."""
    global _model
    _model = model


def installed() -> DeviceModel:
    return _model


def slot_label(worker_name: str, count: int, index: int) -> str:
    """A device's slot name: the worker's own name when it holds one device, else ``<worker>#<index>``."""
    return str(worker_name) if count <= 1 else f"{worker_name}#{index}"


def held(worker: Any) -> int:
    """The devices a Dask worker holds (its ``DEVICES`` resource; 1 when it does not say)."""
    return int(worker.state.total_resources.get(DEVICES_RESOURCE, 1))
