"""An emulated rollout producer: what the task :func:`nexus.sim.tasks.run_rollout` runs on a worker whose
devices the emulator models (:class:`nexus.emulator.worker.EmulatedDevices`).

The producer holds one simulator lane of its worker for the whole task (as a real one holds its SIM
worker; with ``producers_per_sim`` > 1 other producers hold it too, and each reset or step queues behind
theirs on the device) and steps K envs in lockstep: a reset, then per action request — one real ``predict_batch`` to the
tenant's routed engine with observations of the tenant's schema, through the engine's inference queue —
``chunk`` env steps of calibrated time. Episodes have the catalog's length; outcomes are drawn from the
seed. The host's own time — messaging (round trip minus the engine's wait and compute) and the producer's loop
between its steps and requests — is taken off the next step's sleep, so what the emulated producer spends is the
calibrated step time plus the engine's real queueing and forward time, whatever the machine's load.

A CPU-physics env (robosuite, LIBERO: ``ServiceTimes.physics``) steps on the worker's host cores
(:class:`~nexus.emulator.cores.HostCores`), not on its GPU lane, and never on a lent device. A piece of a GPU
producer's work run on a device other than the one holding its envs' state first moves the state there
(``ServiceTimes.move_s``: its bytes over the link, or a reset), and back.
"""

from __future__ import annotations

import math
import time
import uuid

import numpy as np
from distributed import get_worker

from nexus.config import catalog
from nexus.control.dispatch.sim_share import ready_from
from nexus.emulator.clock import DeviceClock
from nexus.emulator.cores import HostCores
from nexus.emulator.host import spend_cpu
from nexus.emulator.lanes import Lanes, lane_label
from nexus.emulator.lent import LentDevices
from nexus.emulator.settings import EmulationSettings, ServiceTimes
from nexus.features import Observation, TenantSchema
from nexus.sim.host import SimHost
from nexus.sim.rollout import ProducerLink, producer_envs
from nexus.wire.engine_client import EngineClient
from nexus.wire.messages import BatchRef, RolloutRequest, RolloutResult
from nexus.wire.signals import emit


def sim_lanes(emu: EmulationSettings) -> tuple[Lanes, HostCores]:
    """The worker's simulator lanes — the devices behind its ``SIM`` places, each for the producers per device — and
    the host cores its CPU-physics producers step on."""
    places = int(get_worker().state.total_resources.get("SIM", 1))
    return Lanes(emu.sim_devices(places), emu.producers_per_sim), HostCores(emu.host_cores(places))


def producer_load(req: RolloutRequest, emu: EmulationSettings, times: ServiceTimes, envs: int) -> float:
    """What the producer tells its worker's lanes (``EmulationSettings.sim_placement``): with ``"load"``, the share
    of a device's time it steps alone (none for a CPU-physics env: it steps on host cores); with ``"fewest"``,
    nothing (0), so lanes are told apart by their count."""
    if emu.sim_placement != "load" or times.physics(req.env) == "cpu":  # a CPU-physics producer leaves its GPU idle
        return 0.0
    spec = req.tenant.spec
    return times.stepping_share(req.env, envs, times.family(spec.env, spec.action_head))


def observation(schema: TenantSchema) -> Observation:
    """A blank observation of the tenant's schema (what the engine's request gate checks)."""
    return Observation(state=np.zeros(schema.proprio_dim, np.float32),
                       images={c.name: np.zeros((c.height, c.width, 3), np.uint8) for c in schema.cameras},
                       instruction=schema.instruction)


def run_rollout(sim: SimHost, req: RolloutRequest, emu: EmulationSettings, lanes: Lanes,
                lent: LentDevices | None, cores: HostCores | None = None) -> RolloutResult:
    """``lanes``: the worker's simulator devices; ``lent``: the devices other services lend it (None: no lending);
    ``cores``: its host cores, where a CPU-physics env steps (None: one per env)."""
    t_start = time.time()
    times = emu.times()
    entry = catalog.env(req.env)
    cost = times.env(req.env)
    length = cost.episode_steps or entry.max_episode_steps
    k = producer_envs(entry, req.datapath.envs_per_producer, req.episodes)
    cpu_physics = times.physics(req.env, entry.simulator) == "cpu"  # CPU MuJoCo: host cores, never a (lent) GPU
    if cpu_physics:
        cores, lent = cores or HostCores(k), None
    move_s = times.move_s(req.env, k)
    rl = req.version is None
    kind = "rollout" if rl else "eval"
    name = req.tenant.name
    asked = time.time()
    with (lanes.hold(1, load=producer_load(req, emu, times, k)) as (lane,),
          sim.producer(f"{req.job}:{req.offset}", req.job or "", name, kind) as progress):
        t0 = time.time()
        clock = DeviceClock(times.k)
        ready = ready_from(req.ready_at, asked, t0)
        if ready:  # the host's dispatch since the batch or update that let it start ended is owed
            clock.owe(t0 - ready)
        routes = {name: req.route} if req.route is not None else None
        engine = EngineClient(get_worker(), routes=routes, on_answer=progress.tick)
        link = ProducerLink(engine, name, req.version, req.deterministic, req.job,
                            f"{name}/{req.job}/{uuid.uuid4().hex[:8]}", features=False, features_max_dim=0)
        obs = observation(req.tenant.schema)
        wait = rtt = engine_wait = compute = lent_s = 0.0
        host_work = emu.device_work == "host_cpu"  # this host's own cores stand for the devices
        request_cpu_s = times.cal.host.sim_request_s if host_work else 0.0
        pieces = []  # those run on lent devices (what pushed them too late is read at the end)
        requests = rows = 0
        versions: set[int] = set()

        state_on: str | None = None  # the lent device holding its envs' state (None: its own)

        def run_on_device(seconds: float, unit: float | None = None) -> None:
            """``seconds`` of device work (steps of ``unit``) on the producer's device, or (``lend_actor``,
            ``lend_inference``) on a lent one while that ends sooner, the state's move there included: its owner
            may run its own work there (slowing the piece), or take it back between two steps, and the rest runs
            here again, the state moved back. Steps revoked on a lent device since (its owner took it back before
            they began, on its devices' clock) run again first. A CPU-physics env's work takes host cores."""
            nonlocal lent_s, state_on
            if host_work:  # on this host's cores (device_work "host_cpu": no lending)
                clock.spend_on_host(seconds, lanes.locks[lane])
                return
            if cpu_physics:
                if seconds <= 0:
                    return
                clock.settle()
                clock.spend(seconds, queued=cores.place(k, seconds, ahead=clock.debt))
                return
            redo = sum(p.take_revoked() for p in pieces)
            if redo > 0:
                clock.revoke(redo)
                lent_s -= redo
                seconds += redo
            while seconds > 1e-9:
                clock.settle()  # the loop's host time since is owed too: the device saw the piece arrive that early
                queued, piece, borrowed = lanes.place(lane, seconds, ahead=clock.debt, lent=lent, unit=unit,
                                                      move_s=move_s, state_on=state_on)
                if not borrowed:  # its own device: pushed back, not cut, by pieces that came earlier
                    clock.spend(piece.seconds, queued=queued, cut=piece.wait_cut)
                    state_on = None
                    return
                ran = clock.spend(piece.seconds, queued=queued, cut=piece.wait_cut)
                pieces.append(piece)
                lent_s += ran
                if ran > 0:
                    state_on = piece.device
                seconds -= max(0.0, ran - piece.lead)  # the move ran no step

        link.open()
        try:
            for first in range(0, req.episodes, k):
                n = min(k, req.episodes - first)
                run_on_device(times.reset_s(req.env))
                for c in range(math.ceil(length / cost.chunk)):
                    spend_cpu(request_cpu_s)  # the request's handling on the host's cores (observations, reply)
                    clock.settle()  # the request was made as early on the devices' clock as the host time owed
                    ahead = clock.debt
                    sent = time.perf_counter()
                    reply = link.submit([obs] * n, lead_s=ahead).result()
                    got = time.perf_counter() - sent
                    versions.update(int(o.version) for o in reply.outputs)
                    served = reply.engine_wait_s + reply.compute_s
                    # messaging: the host's, not the emulated devices'; the engine's wait from before the request's
                    # arrival is the devices' time the debt stood for
                    clock.message(got, served, paid=min(ahead, reply.engine_wait_s))
                    wait += min(got, served)
                    rtt, engine_wait, compute = rtt + got, engine_wait + reply.engine_wait_s, compute + reply.compute_s
                    requests, rows = requests + 1, rows + n
                    steps = min(cost.chunk, length - c * cost.chunk)
                    step = times.step_s(req.env, n)
                    run_on_device(step * steps, unit=step)
            run_on_device(0.0)  # steps revoked meanwhile
        finally:
            link.close()
        clock.settle()
        t1 = time.time()
        ended = t1 - clock.debt  # on the devices' clock: the host time still owed is not the devices'
    missed = sum(p.missed + p.take_revoked() for p in pieces)  # heard of too late: what the emulation got for free
    rng = np.random.default_rng([emu.seed, req.seed % 2**32, req.offset])
    success = rng.random(req.episodes) < cost.success
    returns = rng.random(req.episodes) * length * (0.5 + success)
    steps_total = req.episodes * length
    stats = {"episodes": req.episodes, "steps": steps_total,
             "mean_return": float(returns.mean()) if req.episodes else 0.0,
             "success_rate": float(success.mean()) if req.episodes else 0.0, "envs": k, "waves": 1,
             "sim_s": clock.slept, "action_wait_s": wait, "requests": requests, "rows": rows, "timed": requests,
             "rtt_s": rtt, "engine_wait_s": engine_wait, "compute_s": compute, "device_queue_s": clock.queued,
             "lent_s": lent_s, "lent_missed_s": missed, "messaging_s": max(0.0, rtt - engine_wait - compute)}
    emit("rollout", tenant=name, job=req.job, t0=t0, t1=t1, what="rl" if rl else "eval", steps=steps_total,
         sim_s=clock.slept, action_wait_s=wait, lent_s=lent_s, lent_missed_s=missed,
         device=lane_label(get_worker().name, lanes.n, lane), queued_s=t0 - t_start)
    batch = None
    if rl:
        batch = BatchRef(path="", rows=steps_total, episodes=req.episodes, policy_version=min(versions, default=0),
                         tenant=name, ended_at=ended)
    return RolloutResult(stats=stats, versions=sorted(versions), batch=batch)
