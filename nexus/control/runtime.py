"""The control plane's one door to Dask: tasks by import path, worker RPC, worker lookup.

Runs on the scheduler's event loop. Tasks are submitted through an asynchronous ``Client`` created
in that loop; calls to the roles hosted by workers (:mod:`nexus.worker.plugin`) go through
the scheduler's own connection pool as plain msgpack messages (the scheduler never unpickles worker
data). Nothing here blocks the loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nexus.control.tasks import TaskRef
from nexus.deploy.tls import security
from nexus.errors import Unavailable, from_reply
from nexus.wire.dask_streams import send_promptly

if TYPE_CHECKING:
    from nexus.config.service import ServiceConfig

logger = logging.getLogger("nexus.runtime")


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    address: str
    resources: dict[str, float]


class DaskRuntime:
    def __init__(self, scheduler, config: ServiceConfig | None = None) -> None:
        self.scheduler = scheduler
        self.config = config
        self._client = None
        self._client_lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()

    async def client(self):
        async with self._client_lock:
            if self._client is None:
                from distributed import Client


                self._client = await Client(self.scheduler.address, asynchronous=True, name="nexus-master",
                                            set_as_default=False, security=security(self.config))
                # its submissions, and the scheduler's reports back (tasks done), without Dask's batching wait
                send_promptly(self._client.scheduler_comm)
                send_promptly(self.scheduler.client_comms.get(self._client.id))
            return self._client

    async def close(self) -> None:
        for t in list(self._background):
            t.cancel()
        if self._client is not None:
            await self._client.close()
            self._client = None

    def spawn(self, coro) -> asyncio.Task:
        """A background task the runtime keeps a reference to (and cancels at close)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- tasks ------------------------------------------------------------------------------------
    async def submit(self, task: TaskRef, *args: Any, key: str, workers: list[str] | None = None,
                     resources: dict[str, float] | None = None):
        client = await self.client()
        return client.submit(task, *args, key=key, workers=workers, allow_other_workers=False,
                             resources=resources, pure=False)

    async def run(self, task: TaskRef, *args: Any, key: str, workers: list[str] | None = None,
                  resources: dict[str, float] | None = None) -> Any:
        """Submit and wait; cancelling the caller cancels the task."""
        fut = await self.submit(task, *args, key=key, workers=workers, resources=resources)
        try:
            return await fut
        except asyncio.CancelledError:
            self.cancel([fut])
            raise

    async def gather(self, futures: list) -> list[Any]:
        client = await self.client()
        return await client.gather(futures)

    def cancel(self, futures: list) -> None:
        """Cancel Dask futures without waiting (safe inside a task that is being cancelled)."""
        if self._client is None or not futures:
            return

        async def _cancel() -> None:
            try:
                await self._client.cancel(futures, force=True)
            except Exception as e:  # the cluster may be closing
                logger.debug("cancel: %s", e)

        self.spawn(_cancel())

    # -- workers --------------------------------------------------------------------------------------
    def workers(self, resource: str | None = None) -> list[WorkerInfo]:
        out = [WorkerInfo(str(ws.name), ws.address, dict(ws.resources)) for ws in self.scheduler.workers.values()
               if resource is None or ws.resources.get(resource, 0) > 0]
        return sorted(out, key=lambda w: (w.name, w.address))

    def has_worker(self, address: str) -> bool:
        return address in self.scheduler.workers

    def worker_name(self, address: str) -> str | None:
        ws = self.scheduler.workers.get(address)
        return None if ws is None else str(ws.name)

    async def call(self, address: str, handler: str, timeout: float | None = 60.0, **msg: Any) -> Any:
        """Call ``handler`` of the worker at ``address`` (a role hosted by its Nexus plugin)."""
        if address not in self.scheduler.workers:
            raise Unavailable(f"worker {address} is not in the cluster")
        coro = getattr(self.scheduler.rpc(address), handler)(**msg)
        reply = await (asyncio.wait_for(coro, timeout) if timeout else coro)
        error = from_reply(reply)  # a NexusError the worker refused with, its class kept (nexus.errors.to_reply)
        if error is not None:
            raise error
        return reply

    async def io(self, action: str, prefer: tuple[str, ...] = ("INFER", "ACTOR", "SIM"), **msg: Any) -> Any:
        """Small file I/O (job records) on some live worker, off the scheduler's loop."""
        seen: set[str] = set()
        for resource in (*prefer, None):
            for w in self.workers(resource):
                if w.address in seen:
                    continue
                seen.add(w.address)
                try:
                    return await self.call(w.address, "nexus_io", action=action, **msg)
                except Exception as e:
                    logger.info("nexus_io %s on %s: %s", action, w.name, e)
        raise Unavailable(f"no worker could run {action!r}")

    async def broadcast(self, resource: str, handler: str, **msg: Any) -> int:
        """Call ``handler`` on every worker with ``resource`` at once (best effort) -> how many answered."""
        workers = self.workers(resource)
        out = await asyncio.gather(*(self.call(w.address, handler, timeout=10.0, **msg) for w in workers),
                                   return_exceptions=True)
        for w, r in zip(workers, out, strict=True):
            if isinstance(r, BaseException):
                logger.info("%s on %s: %s", handler, w.name, r)
        return sum(not isinstance(r, BaseException) for r in out)

    async def restart_worker(self, address: str) -> None:
        """Ask the worker's nanny to restart its process (a role that stopped answering)."""
        try:
            await self.scheduler.restart_workers([address], timeout=30, wait_for_workers=False, on_error="return",
                                                 stimulus_id="nexus-health")
        except Exception as e:
            logger.warning("restarting worker %s: %s", address, e)
