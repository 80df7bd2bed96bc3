"""An emulated actor rank (:mod:`nexus.emulator`): the tasks of :mod:`nexus.actor.tasks` with the
same names, arguments and results, but an update *takes* its calibrated time on the rank's device lanes
instead of computing (no torch, no DeepSpeed: a slot is its version counter).

What stays real: the tenant's output dir (manifest, version 0, job records), the version numbering, and
the weight-sync messages — a new version is pushed to every engine of the request (``EngineSet``), with a
token payload, when the sync rule says so; the push's calibrated cost is spent on the update's lanes.
The rank hands these functions to the control plane's task references (:attr:`EmulatedActorHost.tasks`),
so the scheduler submits exactly the tasks it submits to a real rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from distributed import get_worker

from nexus.actor.slot_rebuild import rebuild_each
from nexus.config.service import ServiceConfig
from nexus.data.output_dir import TenantOutputDir
from nexus.data.tenant_dirs import job_seq
from nexus.emulator.clock import DeviceTimeline
from nexus.emulator.host import spend_cpu
from nexus.emulator.lanes import Lanes, lane_label
from nexus.emulator.lender import DeviceLender
from nexus.emulator.settings import EmulationSettings
from nexus.errors import SpecError, Unavailable
from nexus.wire.engine_client import EngineSet
from nexus.wire.messages import EngineEndpoint, OpWork, RLWork, SlotInfo, TenantSetup, UpdateRequest, UpdateResult
from nexus.wire.signals import emit

TOKEN_WEIGHTS = b"emulated-head"  # what a weight-sync message carries instead of a head


class UpdateTimeline:
    """The actor devices' own clock (wall-clock seconds, a :class:`DeviceTimeline`): an update starts when it could —
    its batch ended, its job's update before it ended — or when its devices ended their work before, whichever is
    later, and lasts its calibrated time. The host's dispatch of it (a round trip through the scheduler, the same
    milliseconds at any time scale k, k-fold in emulated seconds) is on it by the share a run at the devices' speed
    would see (1/k): the rank sleeps to the devices' end, less when the update reached it late."""

    def __init__(self, n: int, k: float = 1.0, now: Callable[[], float] = time.time) -> None:
        self.devices = DeviceTimeline(n, k)
        self.now = now  # the wall clock (a test's own keeps the devices' clock exact)
        self.job_end: dict[str, float] = {}  # a job's last update's end

    def start(self, lanes: list[int], ready_at: float) -> float:
        """The update's start on ``lanes``: ``ready_at`` (never after now; 0: now) or the lanes' last end, plus the
        host's share."""
        now = self.now()
        return self.devices.start(lanes, ready_at if ready_at > 0 else now, now)

    def end(self, lanes: list[int], t1: float, job: str | None) -> None:
        self.devices.end(lanes, t1)
        if job:
            self.job_end[job] = t1


class EmulatedActorHost:
    """One emulated actor rank: ``devices.actor`` lanes; an update holds ``emulation.group`` of them."""

    def __init__(self, config: ServiceConfig, emu: EmulationSettings, rank: int = 0, world_size: int = 1) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.times = emu.times()
        self.group = emu.group
        self.lanes = Lanes(emu.devices.actor)
        self.timeline = UpdateTimeline(emu.devices.actor, self.times.k)
        self.versions: dict[str, int] = {}  # tenant -> its slot's version
        self.synced: dict[str, int] = {}
        self.offloaded: dict[str, int] = {}
        self.rendezvous = None
        self.lender = DeviceLender() if emu.lend_actor else None  # idle devices step simulators
        self.on_host = emu.device_work == "host_cpu"  # updates spend CPU on the host's cores (nexus.emulator.host)
        self.item_cpu_s = emu.table.host.actor_item_s if emu.table is not None else 0.0

    @property
    def slots(self) -> dict[str, int]:  # the heartbeat counts slots
        return self.versions

    @property
    def writes(self) -> bool:
        return self.rank == 0

    def label(self, lane: int) -> str:
        return lane_label(get_worker().name, self.lanes.n, lane)

    @property
    def tasks(self) -> dict[str, Any]:
        """``nexus.control.tasks`` paths this host runs itself."""
        return {f"nexus.actor.tasks:{f.__name__}": f for f in (
            init_tenant, rebuild_slots, run_update, finish_job, drop_tenant, offload_slots, export_version)}


def init_tenant(actor: EmulatedActorHost, setup: TenantSetup) -> SlotInfo:
    """The tenant's output dir and version 0 (a token head the engines register), as a real rank writes them."""
    out = TenantOutputDir(setup.output_dir)
    if actor.writes and not out.exists():
        out.create(setup.spec.model_dump(), setup.schema.to_dict())
    if actor.writes and not out.weights_path(0).exists():
        out.write_weights(0, TOKEN_WEIGHTS)
        out.add_version(0, "init")
    published = out.highest_version() if out.exists() else 0
    version = max(actor.versions.get(setup.name, 0), published)
    actor.versions[setup.name] = actor.synced[setup.name] = version
    return SlotInfo(setup.name, version, False, None, published, job_seq(out) if out.exists() else 0)


def rebuild_slots(actor: EmulatedActorHost, setups: list[TenantSetup], offloaded: list[str] = ()) -> dict[str, Any]:
    return rebuild_each(setups, lambda s: init_tenant(actor, s))


def drop_tenant(actor: EmulatedActorHost, tenant: str) -> bool:
    actor.versions.pop(tenant, None)
    actor.synced.pop(tenant, None)
    return True


def offload_slots(actor: EmulatedActorHost, setups: list[TenantSetup]) -> dict[str, Any]:
    """An emulated slot holds no memory: nothing to offload."""
    return {"offloaded": [], "kept": {s.name: "emulated slots hold no memory" for s in setups}}


def _work_size(work: Any) -> tuple[str, int, int]:
    """(kind, rows, epochs) of a training item."""
    if isinstance(work, RLWork):
        return "rl", work.batch.rows, work.config.update_epochs
    if isinstance(work, OpWork):
        raise SpecError("low-level ops are not emulated: an emulated service runs SFT and RL jobs")
    return "sft", work.batch_size, 1


def run_update(actor: EmulatedActorHost, req: UpdateRequest, data: Any = None) -> UpdateResult:
    """One training item: its calibrated time on ``group`` lanes, a new version, the weight push."""
    name = req.tenant.name
    if name not in actor.versions:
        raise Unavailable(f"tenant {name!r} has no slot on this actor rank (it restarted?): the control plane "
                          "rebuilds it")
    kind, rows, epochs = _work_size(req.work)
    engines = EngineSet(get_worker(), req.engines)
    with actor.lanes.hold(actor.group) as lanes:
        duration = actor.times.update_s(kind, rows, epochs, len(lanes))
        version = actor.versions[name] + 1
        push = actor.writes and req.sync.should_push(version)
        devices = [actor.label(lane) for lane in lanes]
        if actor.on_host:  # the item's handling, then the update, on the host's cores: its wall time is charged
            spend_cpu(actor.item_cpu_s)
            start = time.time()
            duration = spend_cpu(duration)
        else:
            start = actor.timeline.start(lanes, _ready_at(actor, req))
        # taken back at that start, not at this late arrival (the host's dispatch): steps lent since are run again
        back = actor.lender.reclaim(devices, start) if actor.lender is not None else 0.0
        t0 = max(start, back)  # their simulator work (its last step begun by then) ends then
        t1 = t0 + duration + (actor.times.sync_s() if push else 0.0)
        _sleep_until(t0 + duration)
        actor.versions[name] = version
        sync_s = 0.0
        if push:
            sync_s = _push(actor, engines, name, version)
        _sleep_until(t1)
        actor.timeline.end(lanes, t1, req.job)
        if actor.lender is not None:
            actor.lender.lend(devices, t1)
    pushed = float(len(TOKEN_WEIGHTS)) if engines.pushed_to else 0.0
    for i, device in enumerate(devices):  # every device of the group was busy: each is charged (the push once)
        emit("update", tenant=name, job=req.job, what=kind, t0=t0, t1=t1, device=device,
             sync_s=sync_s if i == 0 else 0.0, sync_bytes=pushed if i == 0 else 0.0, synced=bool(pushed) and i == 0)
    metrics = {"update_s": t1 - t0, "emulated_s": duration, "rows": float(rows), "loss": 0.0,
               "weight_sync_s": sync_s}
    return UpdateResult(version=version, metrics=metrics, pushed_to=tuple(engines.pushed_to),
                        push_errors=tuple(engines.errors), ended_at=t1)


def _ready_at(actor: EmulatedActorHost, req: UpdateRequest) -> float:
    """When the item could start on the devices' clock: its batch's end (an RL update) and its job's update before
    it; 0 when neither is known (its start is then its arrival here)."""
    batch = getattr(req.work, "batch", None)
    return max(batch.ended_at if batch is not None else 0.0, actor.timeline.job_end.get(req.job or "", 0.0))


def _sleep_until(t: float) -> None:
    left = t - time.time()
    if left > 0:
        time.sleep(left)


def _push(actor: EmulatedActorHost, engines: EngineSet, tenant: str, version: int) -> float:
    """A real weight-sync message (token payload) to every engine; its calibrated cost is on the lanes."""
    t0 = time.perf_counter()
    engines.load_weights(tenant, version, TOKEN_WEIGHTS).result()
    actor.synced[tenant] = version
    return time.perf_counter() - t0


def finish_job(actor: EmulatedActorHost, tenant: str, output_dir: str, record: dict, checkpoint: bool,
               version: int | None = None, engines: tuple[EngineEndpoint, ...] = ()) -> dict[str, Any]:
    """The job's record in the tenant's output dir, and the last version pushed if lazy sync held it back."""
    out = TenantOutputDir(output_dir)
    actor.timeline.job_end.pop(str(record.get("job")), None)  # the job's updates are over
    if not actor.writes:
        return {"artifacts": []}
    if record.get("history") is None:
        out.write_job(record)
    out.add_job(record)
    res: dict[str, Any] = {"artifacts": [str(out.manifest_path)]}
    current = actor.versions.get(tenant)
    if engines and current is not None and actor.synced.get(tenant) != current:
        sync_s = _push(actor, EngineSet(get_worker(), engines), tenant, current)
        _sleep_until(time.time() + actor.times.sync_s() - sync_s)  # the push's calibrated cost, as before a job ends
        res["sync"] = {"version": current, "pushed": True, "weight_sync_s": sync_s}
    return res


def export_version(actor: EmulatedActorHost, setup: TenantSetup, version: int, path: str | None = None) -> dict:
    raise Unavailable("an emulated service has no weights to export")
