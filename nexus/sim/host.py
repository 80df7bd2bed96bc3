"""A simulator worker's state (resource ``SIM``): its idle simulators, kept between rollout tasks, the
producers running now (reported in the worker's heartbeat, so the health manager sees their progress) and
the tenants' environment sessions (:mod:`nexus.sim.env_sessions`).

Held by the worker's Nexus plugin and passed to the SIM tasks (:mod:`nexus.sim.tasks`).
Simulator packages come in with the first env a task builds.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from nexus.config.catalog import EnvEntry
from nexus.sim.env_sessions import SessionTable
from nexus.sim.environment import LockstepEnvs, make_env
from nexus.wire.messages import ProducerReport


class EnvPool:
    """Idle simulators of one worker process, reused across its rollout tasks: single envs stepped in
    lockstep, and gymnasium async vector envs by size."""

    def __init__(self) -> None:
        self._single: dict[str, list[Any]] = {}  # env name -> idle single envs
        self._vectors: dict[tuple[str, int], list[Any]] = {}  # (env name, size) -> idle vector envs
        self._lock = threading.Lock()

    def checkout(self, entry: EnvEntry, sizes: list[int], mode: str) -> list[Any]:
        """Env groups of these sizes for one task (idle ones first, else new)."""
        groups = []
        for n in sizes:
            if mode == "lockstep":
                with self._lock:
                    idle = self._single.setdefault(entry.name, [])
                    envs, idle[:] = idle[:n], idle[n:]
                envs += [make_env(entry, num_envs=1) for _ in range(n - len(envs))]
                groups.append(LockstepEnvs(envs))
            else:
                with self._lock:
                    idle = self._vectors.setdefault((entry.name, n), [])
                    env = idle.pop() if idle else None
                if env is None:
                    env = make_env(dataclasses.replace(entry, vector_mode="async"), num_envs=n) if n > 1 \
                        else make_env(entry, num_envs=1)
                groups.append(env)
        return groups

    def checkin(self, entry: EnvEntry, groups: list[Any], mode: str) -> None:
        with self._lock:
            for g in groups:
                if mode == "lockstep":
                    self._single.setdefault(entry.name, []).extend(g.envs)
                else:
                    self._vectors.setdefault((entry.name, g.num_envs), []).append(g)

    def idle(self, name: str) -> int:
        with self._lock:
            return len(self._single.get(name, [])) + sum(len(v) for (n, _), v in self._vectors.items() if n == name)


@dataclass
class ProducerProgress:
    job: str
    tenant: str
    kind: str
    requests: int = 0
    t_progress: float = 0.0
    stopped: bool = False  # its job was cancelled: the producer stops before its next step

    def tick(self) -> None:
        self.requests += 1
        self.t_progress = time.time()


class SimHost:
    def __init__(self) -> None:
        self.pool = EnvPool()
        self.producers: dict[str, ProducerProgress] = {}
        # environment sessions (tenants' own algorithms): every call of every session runs on one thread
        self.sessions = SessionTable(self.pool)
        self.session_thread = ThreadPoolExecutor(1, thread_name_prefix="nexus-env-sessions")
        self.stopped_jobs: deque[str] = deque(maxlen=1024)  # cancelled jobs: their producers do not start

    @contextmanager
    def producer(self, key: str, job: str, tenant: str, kind: str) -> Iterator[ProducerProgress]:
        """A running producer, listed in the heartbeat until it ends."""
        p = self.producers[key] = ProducerProgress(job, tenant, kind, t_progress=time.time(),
                                                   stopped=bool(job) and job in self.stopped_jobs)
        try:
            yield p
        finally:
            if self.producers.get(key) is p:
                del self.producers[key]

    def stop(self, job: str) -> int:
        """The job was cancelled: its running producers stop before their next step, later ones at once
        (a cancelled Dask task already running is not interrupted by Dask). -> producers stopped now."""
        if job not in self.stopped_jobs:
            self.stopped_jobs.append(job)
        mine = [p for p in list(self.producers.values()) if p.job == job]
        for p in mine:
            p.stopped = True
        return len(mine)

    def reports(self) -> list[dict[str, Any]]:
        return [ProducerReport(p.job, p.tenant, p.kind, p.requests, p.t_progress).to_dict()
                for p in list(self.producers.values())]
