"""Running workloads on an emulated service (``nexus.emulator.service.local``): one service per device layout,
its tenants created once, each policy's run submitted on the same service (``nexus_set_scheduler`` on the idle
service), measured by the service's own accounting (``nexus_accounting``), the training queue's delays
(``status()["training_queue"]["delay_s"]``) and every engine's per-tenant action-request waits.

Used by ``bench.py`` (paper scale, 64 devices) and ``validate.py`` (the real CPU run predicted).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nexus.config.service import Scheduler, nest
from nexus.errors import Conflict
from nexus.spec import TenantSpec


@dataclass
class Job:
    tenant: str
    spec: dict[str, Any]  # TenantSpec fields (name added)
    job: dict[str, Any]  # the job as submitted
    arrival_s: float = 0.0  # seconds after the run's start (bursty arrivals); 0: at once


@dataclass
class Workload:
    name: str
    jobs: list[Job]
    datapath: dict[str, Any] = field(default_factory=dict)

    def tenants(self) -> dict[str, dict[str, Any]]:
        return {j.tenant: j.spec for j in self.jobs}


def policy(name: str, **over: Any) -> dict[str, Any]:
    """A catalog scheduler as a dict (``nexus_set_scheduler``'s argument), with settings named by their names
    over its own (e.g. the actor's concurrency at 64 devices: ``max_concurrent_updates=4``)."""
    return Scheduler.load(name).with_settings(nest(over)).model_dump()


def knob(pol: dict[str, Any], name: str) -> Any:
    """The value of one setting (by its name) in a scheduler made by :func:`policy`."""
    return Scheduler.model_validate(pol).setting(name)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def jain(xs: list[float]) -> float:
    """Jain's fairness index: 1 when every tenant gets the same share, 1/n when one gets everything."""
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else 0.0


class EmulatedService:
    """One emulated service (a device layout, a calibration, a time scale) running workloads under policies."""

    def __init__(self, workload: Workload, devices: str, calibration: str, k: float, first_policy: str,
                 actor_group: int = 0, seed: int = 0, producers_per_sim: int = 1,
                 emulation: dict[str, Any] | None = None) -> None:
        from nexus.emulator.service import local
        from nexus.emulator.settings import DeviceCounts

        self.workload, self.k = workload, k
        self.devices = DeviceCounts.parse(devices)
        emu = {"calibration": calibration, "time_scale": k, "devices": self.devices.model_dump(),
               "actor_group": actor_group, "seed": seed, "producers_per_sim": producers_per_sim,
               **(emulation or {})}
        self.root = Path(tempfile.mkdtemp(prefix="nexus-emulated-")) / "service"
        self.nx = local(self.root, emulation=emu, scheduler=first_policy,
                        datapath=workload.datapath or None)
        self.created: set[str] = set()
        self.add_tenants(workload.jobs)

    def add_tenants(self, jobs: list[Job]) -> None:
        """The tenants of ``jobs`` not created yet (a run's seed makes tenants of its own: their specs' seeds)."""
        for j in jobs:
            if j.tenant not in self.created:
                self.nx.create_tenant(TenantSpec(name=j.tenant, **j.spec))
                self.created.add(j.tenant)
        self.nx.flush()  # the tracker's start-up (its warm-up, the boot's writes) done before a run is timed

    def close(self) -> None:
        self.nx.close()
        shutil.rmtree(self.root.parent, ignore_errors=True)  # a bench's service: nothing in it is kept

    def engines(self) -> list:
        return [self.nx.service.engine(i) for i in range(self.devices.inference)]

    def run(self, pol: dict[str, Any], jobs: list[Job] | None = None, serial: bool = False) -> dict[str, Any]:
        """The workload (or ``jobs``) under ``pol``: jobs submitted at their arrival times — or, ``serial``, all at
        the start one after another in their order (the isolated baseline: each job alone, in turn, its device
        time not charged for waiting on arrivals); accounting over the run."""
        nx = self.nx
        jobs = self.workload.jobs if jobs is None else jobs
        self.add_tenants(jobs)
        nx.service.internal("nexus_set_scheduler", scheduler=pol)
        engines = self.engines()
        for e in engines:
            e.reset_stats().result()
        t0 = time.time()
        handles: dict[str, Any] = {}  # per job: its tenant's name, #i for a tenant's i-th job after its first
        labels, seen = [], {}
        for j in jobs:
            seen[j.tenant] = seen.get(j.tenant, -1) + 1
            labels.append(j.tenant if not seen[j.tenant] else f"{j.tenant}#{seen[j.tenant]}")
        arrival = {n: t0 + (0.0 if serial else j.arrival_s) for n, j in zip(labels, jobs, strict=True)}
        lock = threading.Lock()

        def submit(label: str, j: Job) -> Any:
            delay = arrival[label] - time.time()
            if delay > 0:
                time.sleep(delay)
            for _ in range(600):  # the tenant's previous job ended; the service may not have let it go yet
                try:
                    h = nx.tenant(j.tenant).submit(j.job)
                    break
                except Conflict:
                    time.sleep(0.05)
            else:
                raise RuntimeError(f"{label}: the tenant's previous job never let go")
            with lock:
                handles[label] = h
            return h

        def stream(items: list[tuple[str, Job]], prev: Any = None) -> None:
            """A tenant's jobs in order: each at its arrival, or when the tenant's previous one ends if later (a
            tenant runs one training job at a time)."""
            for label, j in items:
                if prev is not None:
                    prev.result(timeout=7200)
                prev = submit(label, j)

        streams: dict[str, list[tuple[str, Job]]] = {}
        for label, j in zip(labels, jobs, strict=True):
            streams.setdefault(j.tenant, []).append((label, j))
        firsts = {}
        if serial:  # each tenant's first job now, in the workload's order (the isolated policy keeps that order)
            firsts = {t: submit(*items[0]) for t, items in streams.items()}
        threads = [threading.Thread(target=stream, args=(items[1:], firsts[t]) if serial else (items,), daemon=True)
                   for t, items in streams.items()]
        for t in threads:
            t.start()
        spans: dict[tuple, dict] = {}  # the monitoring view keeps the newest 2000 spans: poll as the run goes
        done = threading.Event()

        def poll() -> None:
            since = t0
            while not done.wait(2.0):
                got = nx.monitoring(since=since)["spans"]
                spans.update({(s["service"], s["worker"], s["t0"]): s for s in got})
                since = max([since, *(s["t1"] for s in got)]) - 1.0

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        for t in threads:
            t.join()
        for h in handles.values():
            h.result(timeout=7200)
        t1 = time.time()
        done.set()
        poller.join()
        nx.flush()
        views = {n: h.info() for n, h in handles.items()}
        bad = {n: v["error"] for n, v in views.items() if v["state"] != "done"}
        if bad:
            raise RuntimeError(f"{pol['name']}: jobs did not finish: {bad}")
        acc = nx.service.internal("nexus_accounting", t0=t0, t1=t1)
        st = nx.status(limit=1000)
        waits: dict[str, list[float]] = {}
        sizes: dict[int, int] = {}
        mixed = groups = 0
        for e in engines:
            s = e.engine_stats().result()
            for tenant, w in s["tenant_waits"].items():
                waits.setdefault(tenant, []).extend(w)
            for rows, n in s["size_hist"].items():
                sizes[int(rows)] = sizes.get(int(rows), 0) + n
            groups += sum(s["tenants_hist"].values())
            mixed += sum(n for t, n in s["tenants_hist"].items() if int(t) > 1)
        spans.update({(s["service"], s["worker"], s["t0"]): s for s in nx.monitoring(since=t0)["spans"]})
        return {
            "policy": pol["name"], "t0": t0, "t1": t1, "makespan_s": t1 - t0, "device_s": acc["device_s"],
            "utilization": {s: r["utilization"] for s, r in acc["services"].items()},
            "slots": {s: r["slots"] for s, r in acc["services"].items()},
            "busy_s": {s: r["busy_s"] for s, r in acc["services"].items()},
            "simulator_split_s": acc["services"]["simulator"].get("split_s", {}),
            "busy_le_wall": all(b <= acc["wall_s"] + 1e-6 for r in acc["services"].values()
                                for b in r["busy_per_slot_s"].values()),
            "completion_s": {n: v["t_end"] - t0 for n, v in views.items()},
            "response_s": {n: v["t_end"] - arrival[n] for n, v in views.items()},
            "job_s": {n: v["t_end"] - v["t_start"] for n, v in views.items()},
            "queue_delay_s": st["training_queue"].get("delay_s", {}),
            "action_wait_s": {t: {"p50": pct(w, 0.5), "p99": pct(w, 0.99), "n": len(w)} for t, w in waits.items()},
            "action_wait_all_s": {"p50": pct([x for w in waits.values() for x in w], 0.5),
                                  "p99": pct([x for w in waits.values() for x in w], 0.99)},
            "mean_group_rows": sum(k * v for k, v in sizes.items()) / max(sum(sizes.values()), 1),
            "cross_tenant_share": mixed / max(groups, 1),
            "spans": sorted((s for s in spans.values() if s["t1"] >= t0 and s["t0"] <= t1), key=lambda s: s["t0"]),
        }


def median_of(runs: list[dict[str, Any]], key) -> float:
    return statistics.median(key(r) for r in runs)
