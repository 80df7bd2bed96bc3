"""Rediscovery at boot: the tenants of this service root, from their output dirs, come back.

Once the actor group is up (the supervisor starts it then), the actor lists the root's tenant output
dirs; every tenant found is created again (its slot resumes from its durable state) and every job a
crashed service left running is marked failed — in its record, its manifest and its MLflow run. Job
ids continue past every job number found. ``state`` (``pending`` → ``running`` → ``done`` | ``failed``)
is part of the service's status; ``nexus_wait_ready`` waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from nexus.control import tasks

if TYPE_CHECKING:
    from nexus.control.health.actor_group import ActorGroup
    from nexus.control.jobs.manager import JobManager
    from nexus.control.monitoring.tracking_link import TrackerLink
    from nexus.control.tenants.lifecycle import TenantLifecycle
    from nexus.control.tenants.registry import TenantRegistry

logger = logging.getLogger("nexus.supervisor")

INTERRUPTED = "the service stopped while this job ran"


class Rediscovery:
    def __init__(self, root: str, boot_time: float, actors: ActorGroup, registry: TenantRegistry,
                 lifecycle: TenantLifecycle, jobs: JobManager, tracker: TrackerLink) -> None:
        self.root = root
        self.boot_time = boot_time
        self.actors = actors
        self.registry = registry
        self.lifecycle = lifecycle
        self.jobs = jobs
        self.tracker = tracker
        self.state: dict[str, Any] = {"state": "pending"}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Run once (the first call after the actor group is up)."""
        if self.state["state"] == "pending":
            self.state["state"] = "running"
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def run(self) -> None:
        """Tenants of this root from their output dirs; jobs a crashed service left running become failed."""
        root = self.root
        reason = INTERRUPTED
        found_tenants, interrupted, errors, ended = [], [], {}, {}
        try:
            found = await self.actors.run(tasks.DISCOVER, lambda r: (root,), key="nexus-discover", retry_lost=True,
                                          first_only=True)
            for f in found:
                self.jobs.ids.observe(f["job_seq"])
                ended.update(f.get("ended", {}))
            for f in found:
                name = f["tenant"]
                try:
                    if f["interrupted"]:
                        marked = await self.actors.run(tasks.MARK_INTERRUPTED, lambda r, f=f: (f["output_dir"], reason),
                                                       key=f"nexus-interrupted-{name}", retry_lost=True,
                                                       first_only=True)
                        interrupted.extend(marked)
                    if self.registry.find(name) is None:
                        await self.lifecycle.create(self.lifecycle.read_back(dict(f["spec"])))
                    found_tenants.append(name)
                except Exception as e:
                    errors[name] = f"{type(e).__name__}: {e}"
                    logger.error("rediscovering tenant %s: %s", name, e)
            self.tracker.fail_interrupted(int(self.boot_time * 1000), root, reason, ended)
            self.state = {"state": "done", "tenants": found_tenants, "interrupted": interrupted, "errors": errors,
                          "t": time.time()}
        except Exception as e:
            self.state = {"state": "failed", "error": f"{type(e).__name__}: {e}"}
            logger.exception("rediscovery failed")
