"""An emulated inference engine (:mod:`nexus.emulator`): the real :class:`InferenceEngine` — its inference
queue, group-batching rule, statistics and metering — whose grouped forward *takes* the calibrated time of
its rows and tenants' families (in the engine's model thread, as a real forward would) and answers with
zero actions. Heads are version counters: weight-sync messages move them like real heads.

With ``EmulationSettings.lend_inference`` the engine's device steps simulators between forwards: each forward is
told to the simulator workers as it starts (:class:`~nexus.emulator.lender.DeviceLender`). The two share the
device time-sliced (:meth:`~nexus.emulator.lent.LentDevices.preempt`): a forward that meets lent work there (the
simulator workers tell the engine's worker where it runs until, ``occupied``) progresses ``lend_contention`` times
slower while they overlap, and the steps are pushed back as much."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from typing import Any

import numpy as np
from distributed import get_worker

from nexus.config.service import ServiceConfig
from nexus.emulator.clock import DeviceTimeline
from nexus.emulator.host import spend_cpu
from nexus.emulator.lender import DeviceLender
from nexus.emulator.settings import EmulationSettings
from nexus.engine.engine import InferenceEngine
from nexus.engine.head_versions import HeadVersions
from nexus.engine.queue import Group
from nexus.engine.stats import EngineMeter
from nexus.features import TenantSchema
from nexus.spec import TenantSpec

logger = logging.getLogger("nexus.engine")
SHARE_WEIGHT = 0.1  # the weight of the last forward in the device's share of its time taken by forwards


class EmulatedHeads(HeadVersions[None]):
    """The :class:`~nexus.engine.tenant_heads.TenantHeads` interface without weights."""

    def register(self, spec: TenantSpec, schema: TenantSchema, version: int, weights: bytes) -> None:
        self.specs[spec.name] = (spec, schema)
        self.live[spec.name] = (version, None)

    def load(self, tenant: str, version: int, weights: bytes) -> None:
        self.live[tenant] = (version, None)

    def unregister(self, tenant: str) -> None:
        self.forget(tenant)

    def load_pinned(self, tenant: str, version: int, output_dir: str) -> None:
        return None

    def prefix_cache_stats(self, reset: bool = False) -> dict[str, int]:
        return {}  # no backbone, nothing cached


class EmulatedEngine(InferenceEngine):
    """``device``: the slot its groups are charged to (``<worker>#<engine slot>`` when a worker holds several)."""

    def __init__(self, config: ServiceConfig, emu: EmulationSettings, device: str | None = None,
                 occupied: dict[str, float] | None = None) -> None:
        """``occupied``: its worker's record of the lent work on each device (the end, wall clock)."""
        super().__init__(config)
        self.contention = emu.lend_contention
        self.occupied = occupied if occupied is not None else {}
        self.times = emu.times()
        self.heads = EmulatedHeads()  # type: ignore[assignment]
        self.meter = EngineMeter(pending=lambda: len(self.queue), device=device)
        self._busy = 0.0  # the calibrated time of the group now (or last) running
        # The device keeps its own timeline (monotonic seconds): a group starts when it was ready — its last
        # request in, or its first one's T up when it fired on time — or when the device ended the forward before,
        # plus the share of the host's lateness beyond that a run at the devices' speed would see (``host_share``:
        # the event loop and timers are the same milliseconds at any k; a forward of 2 ms at k = 20 slept as is takes
        # ~3), and ends its calibrated time later. The engine sleeps to that end, and a request's wait and compute
        # are the device's; the rest of the host's time is in the producer's round trip, which it pays back.
        self.timeline = DeviceTimeline(1, self.times.k)  # monotonic seconds, as the queue's arrivals
        self._start = 0.0  # the running group's start on the device's timeline
        self._charged_to = 0.0  # where the last forward charged to the device ends (wall clock, as spans)
        self.queue.waits_of = self._device_waits
        self.queue.compute_of = lambda measured: self._busy
        self.set_batching(config.infer_max_wait_s, config.infer_max_batch)
        self.device = device
        self._worker = self._lending_worker() if emu.lend_inference else None  # the messages go from it
        self.lender = DeviceLender() if self._worker is not None else None
        self.share = 0.0  # the part of the device's time forwards take lately (what lent steps lose to them)
        self.on_host = emu.device_work == "host_cpu"  # forwards spend CPU on the host's cores (nexus.emulator.host)
        self.request_cpu_s = emu.table.host.engine_request_s if emu.table is not None else 0.0
        self._told: set[asyncio.Task] = set()  # messages to the simulator workers on their way

    def _device_waits(self, arrivals: list[float], now: float, reason: str,
                      ahead: list[float] | None = None) -> list[float]:
        """The group's start on the device's timeline, and each request's wait from when it was made on the devices'
        clock (its arrival less its producer's host time still owed, ``ahead``): a producer's late messages keep
        neither its group's other requests waiting nor the device idle, at any k."""
        made = [a - h for a, h in zip(arrivals, ahead or [0.0] * len(arrivals), strict=True)]
        t = self.queue.batcher.max_wait_s
        ready, host_ready = (min(made) + t, min(arrivals) + t) if reason == "timeout" else (max(made), max(arrivals))
        self._start = self.timeline.start([0], ready, now, late_from=host_ready)
        return [max(0.0, self._start - m) for m in made]

    # The group wait T is a time on the devices' clock like every service time: divided by k here, reported in
    # emulated seconds (a T of 5 ms left as is would be 100 emulated ms at k = 20).
    def set_batching(self, max_wait_s: float, max_batch: int) -> dict[str, Any]:
        self.queue.set_limits(max_wait_s / self.times.k, max_batch)
        return self.batching()

    def batching(self) -> dict[str, Any]:
        return {**super().batching(), "max_wait_s": self.queue.batcher.max_wait_s * self.times.k}

    async def _forward_group(self, group: list[Any]) -> list[dict[str, Any]]:
        """The calibrated forward time, slept on the engine's event loop (one group at a time per engine, as
        the real queue fires them): no hop to a model thread, whose wake-up on a loaded host would add
        milliseconds a device would not spend."""
        families = Counter(self._family(r.tenant) for r in group)
        alone = self.times.forward_s(dict(families), len({r.tenant for r in group}))
        if self.on_host:  # in a thread of its own, as a real forward: the loop goes on taking requests
            self._busy = await asyncio.to_thread(self._on_host, alone, len(group))
            self.timeline.end([0], time.monotonic())
            return self._outputs(group)
        self._busy = self.shared_s(alone, self._start + time.time() - time.monotonic())
        end = self._start + self._busy
        if self.lender is not None:
            self._tell(self._start, alone)
        self.timeline.end([0], end)
        left = end - time.monotonic()
        if left > 0:
            await asyncio.sleep(left)
        return self._outputs(group)

    def _on_host(self, forward_s: float, requests: int) -> float:
        """The group's handling and its forward on the host's cores: -> the forward's wall time (what the device is
        charged; the handling is the host's, charged to no device)."""
        spend_cpu(self.request_cpu_s * requests)
        return spend_cpu(forward_s)

    def shared_s(self, alone: float, start: float) -> float:
        """A forward of ``alone`` seconds from ``start`` (wall clock) on a device lent work occupies until its worker's
        record says: time-sliced with it, each ``contention`` times slower while they overlap."""
        lent_until = self.occupied.get(self._lent_name(), 0.0)
        together = min(alone, max(0.0, lent_until - start))
        return alone + (self.contention - 1.0) * together

    def _tell(self, start: float, alone: float) -> None:
        """The simulator workers hear of the forward (``lend_inference``): ``alone`` seconds of it from its start
        (monotonic), time-sliced there with the lent steps. The message is not waited for."""
        end = start + self._busy
        last_end = self.timeline.free_at[0]  # the forward before's (0: none yet)
        interval = end - last_end if last_end else float("inf")
        self.share += SHARE_WEIGHT * (self._busy / max(interval, self._busy) - self.share)
        at = start + time.time() - time.monotonic()
        task = asyncio.ensure_future(self.lender.preempt(self._worker, self._lent_name(), at, alone, self.share))
        self._told.add(task)
        task.add_done_callback(self._told.discard)

    def _lent_name(self) -> str:
        """The name its lent device goes by on the simulator workers: its slot, else its worker's."""
        return self.device or (str(self._worker.name) if self._worker is not None else "")

    @staticmethod
    def _lending_worker() -> Any:
        """The Dask worker hosting the engine (once, not per forward); None outside one: it lends nothing."""
        try:
            return get_worker()
        except ValueError:
            logger.warning("lend_inference: an engine outside a Dask worker lends nothing")
            return None

    def _family(self, tenant: str) -> str:
        """The forward cost a tenant's rows take: its env's when the calibration has one (a camera env), else
        its action head family's."""
        spec = self.heads.specs[tenant][0]
        return self.times.family(spec.env, spec.action_head)

    def _record(self, g: Group) -> None:
        """Charge the device the calibrated forward time, one forward after the other. The sleep is not it: it is
        longer when the timer wakes late and shorter, down to nothing, when the group reached the device's timeline
        late (its start is behind the host's), so charging the sleep lost that part, more of it the larger k and
        the busier the host."""
        t0 = max(g.t0, self._charged_to)
        self._charged_to = t0 + self._busy
        super()._record(dataclasses.replace(g, busy_s=self._busy, t0=t0, t1=self._charged_to))

    def _outputs(self, group: list[Any]) -> list[dict[str, Any]]:
        outs = []
        for r in group:
            spec, schema = self.heads.specs[r.tenant]
            version = self.heads.live[r.tenant][0] if r.version is None else r.version
            outs.append({"action": np.zeros(schema.action_dim, np.float32), "logprob": 0.0, "value": 0.0,
                         "version": version})
        return outs
