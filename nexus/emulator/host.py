"""Device work on the host's own cores (``EmulationSettings.device_work = "host_cpu"``), for a calibration whose
devices *are* this host's CPU cores (``calibrations/cpu_multitenant.toml``, measured on it).

On such a host every service's compute — a forward, an update, a simulator step — and the control plane's own
work (messaging, queues, the scheduler) share the same few cores: when more want to run than there are cores,
each runs slower. A sleep charges none of that, so an emulation calibrated from runs where one tenant kept one core
busy predicts a shared run that would need more cores than the host has. Here device work instead *spends* its
calibrated seconds as CPU time of its own thread (:func:`spend_cpu`), so the operating system shares the cores
between it and everything else the host runs, as it shared them between the real services; the wall time it
takes is what the device is charged. The hash it computes releases the interpreter lock, as a real forward or
physics step does, so threads of one process contend for cores, not for the lock.

A calibration may also say what the real processes spend on the host per unit of work besides the device work
(``Calibration.host``: an engine's handling of an action request, a producer's of a request and its
observations, an actor's of a training item): spent the same way, charged to no device. Only at time scale 1:
seconds of CPU cannot be divided by k."""

from __future__ import annotations

import hashlib
import time

_BLOCK = bytes(64 * 1024)  # hashed a block at a time: ~0.1 ms, the lock released (blocks over 2 KiB)


def spend_cpu(seconds: float, clock=time.thread_time) -> float:
    """Spend ``seconds`` of this thread's CPU time (``clock``: its CPU clock). -> the wall seconds it took: longer
    than ``seconds`` by the share of the cores other work took meanwhile."""
    t0 = time.perf_counter()
    if seconds > 0:
        end = clock() + seconds
        while clock() < end:
            hashlib.sha256(_BLOCK)
    return time.perf_counter() - t0
