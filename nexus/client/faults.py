"""Fault injection for game days, tests and the reliability benchmark: real signals to real processes.

* :func:`kill_worker` — SIGKILL (or another signal) to the process of the worker with a given name (its
  nanny restarts it, as after a crash);
* :func:`kill_worker_while` — the same, at a moment a condition holds with the worker frozen (a kill
  "mid-update" that cannot land between two updates);
* :func:`worker_of_role` — the worker currently hosting a role (``engine/0``, ``actor/0``, ``tracker``);
* :func:`kill_service` — SIGKILL every process of a :class:`nexus.deploy.local.LocalService` at once (a host
  crash): scheduler, nannies and workers.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any


def worker_pids(nx) -> dict[str, int]:
    """Worker name -> pid of its process (not its nanny), through the internal access of the process that
    started the service (``nx.service``)."""
    info = nx.service.client.scheduler_info(n_workers=-1)["workers"]
    pids = nx.service.client.run(os.getpid)
    return {str(info[a]["name"]): pid for a, pid in pids.items() if a in info}


def worker_of_role(nx, role: str) -> str:
    for r in nx.status()["roles"]:
        if r["role"] == role and r["worker"]:
            return r["worker"]
    raise LookupError(f"role {role!r} is not placed on a worker")


def kill_worker(nx, name: str, sig: int = signal.SIGKILL) -> int:
    """Signal the worker process named ``name``; returns its pid."""
    pid = worker_pids(nx)[name]
    os.kill(pid, sig)
    return pid


def kill_worker_while(nx, name: str, busy: Callable[[], Any], timeout: float = 120, settle_s: float = 0.5) -> int:
    """SIGKILL the worker named ``name`` while ``busy()`` holds; returns its pid.

    Polling ``busy()`` and then killing races: what ran may end between the two. So the worker is frozen
    (SIGSTOP) first and ``busy()`` asked again after ``settle_s`` (replies already on their way land): what
    is still running then cannot end before the kill. If ``busy()`` no longer holds, the worker resumes and
    the wait starts again."""
    pid = worker_pids(nx)[name]
    deadline = time.time() + timeout
    while True:
        wait_for(busy, max(deadline - time.time(), 0.0), 0.02, f"{name} busy")
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(settle_s)
            still = busy()
        except BaseException:
            os.kill(pid, signal.SIGCONT)  # never leave a worker frozen behind an error
            raise
        if still:
            os.kill(pid, signal.SIGKILL)
            return pid
        os.kill(pid, signal.SIGCONT)


def kill_service(service) -> list[int]:
    """SIGKILL every process group of a LocalService (scheduler, nannies, workers) without any clean-up."""
    pgids = [p.pid for p in service.procs]
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in service.procs:
        p.wait()
    service.procs.clear()
    return pgids


def wait_for(predicate, timeout: float, poll_s: float = 0.25, what: str = "condition") -> Any:
    """Poll ``predicate()`` until it returns something truthy; raise TimeoutError after ``timeout`` s."""
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.time() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:g} s")
        time.sleep(poll_s)
