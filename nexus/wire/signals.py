"""Monitoring signals: what workers send to the control plane, and the one function that sends them.

Shared by both sides (no torch, no I/O): workers call :func:`emit`, which puts the signal on the
worker's Dask event stream (topic :data:`TOPIC`); the scheduler plugin ingests those events
(:mod:`nexus.control.monitoring.state`).
"""

from __future__ import annotations

from typing import Any

TOPIC = "nexus-signal"
SERVICES = ("actor", "inference", "simulator")


def emit(kind: str, **msg: Any) -> None:
    """Send a signal from a worker task or actor (no-op outside a Dask worker)."""
    from distributed import get_worker

    try:
        worker = get_worker()
    except ValueError:
        return
    worker.log_event(TOPIC, {"kind": kind, "worker": worker.name, **msg})
