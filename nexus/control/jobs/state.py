"""A job's record on the control plane and its states.

States: ``queued`` → ``running`` → ``done`` | ``failed`` | ``cancelled``; a job still waiting for admission
(isolated mode) ends ``cancelled`` (by request) or ``failed`` (the service closed) without running. The
allowed moves are :data:`TRANSITIONS`; :meth:`JobState.move` refuses any other.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from nexus.control.transitions import move
from nexus.spec import EvalJob, RLJob, SFTJob


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.RUNNING, JobStatus.CANCELLED, JobStatus.FAILED}),
    JobStatus.RUNNING: frozenset({JobStatus.DONE, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.DONE: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}
TERMINAL = frozenset(s for s, nexts in TRANSITIONS.items() if not nexts)


@dataclass
class JobState:
    job_id: str
    tenant: str
    spec: SFTJob | RLJob | EvalJob
    state: JobStatus = JobStatus.QUEUED
    progress: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    error: str | None = None
    t_submit: float = field(default_factory=time.time)
    t_start: float | None = None  # admitted (isolated mode: later than t_submit)
    t_end: float | None = None
    cancel_requested: bool = False
    run_started: bool = False  # its tracker run was asked for (an evaluation may nest under it only then)
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # ended and recorded (checkpoint, MLflow)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # in its final state (recording may follow)
    task: asyncio.Task | None = None

    def move(self, new: JobStatus, error: str | None = None) -> None:
        """Change state (only as :data:`TRANSITIONS` allows); ``error``: why it failed or was cancelled."""
        self.state = move(f"job {self.job_id!r}", self.state, JobStatus(new), TRANSITIONS)
        if error is not None:
            self.error = error

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def view(self) -> dict[str, Any]:
        return {"job": self.job_id, "tenant": self.tenant, "kind": self.spec.kind, "state": str(self.state),
                "spec": self.spec.model_dump(), "progress": dict(self.progress), "result": self.result,
                "error": self.error, "t_submit": self.t_submit, "t_start": self.t_start, "t_end": self.t_end}

    def record(self) -> dict[str, Any]:
        return {k: v for k, v in self.view().items() if k != "progress"} | {"progress": dict(self.progress)}
