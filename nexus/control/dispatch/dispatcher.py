"""Training-queue dispatcher: moves admitted items from the :class:`TrainingQueue` to the actor group.

Its two knobs come from :class:`nexus.config.service.DispatchSettings`: how many items run at once
(``max_concurrent_updates``; a scheduler switch changes it, :meth:`Dispatcher.apply`) and how
often an item that raises is retried (``item_attempts``). An item whose actor rank was lost
(``RoleLost``) goes back to the head of the queue, keeps its admission slot, and runs again once the
actor group has been rebuilt; that retry does not count as an attempt (the actor's restart budget
bounds it). Every other outcome —
result, final error, cancellation of a queued item — frees the item's admission slot.

A plain asyncio object: the work itself is the injected ``execute(item)`` coroutine, so the
dispatcher is unit-tested without a cluster.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from nexus.config.service import DispatchSettings
from nexus.control.dispatch.training_queue import TrainingItem, TrainingQueue
from nexus.errors import RoleLost

if TYPE_CHECKING:
    from nexus.config.service import ServiceConfig

logger = logging.getLogger("nexus.dispatcher")


Execute = Callable[[TrainingItem], Awaitable[dict[str, Any]]]


class Dispatcher:
    def __init__(self, queue: TrainingQueue, execute: Execute, versions: Callable[[], dict[str, int]],
                 settings: DispatchSettings | None = None, available: Callable[[], bool] = lambda: True) -> None:
        settings = settings or DispatchSettings()
        self.queue = queue
        self.max_concurrent = settings.max_concurrent_updates  # items running at once (DeepSpeed steps are collective)
        self.item_attempts = settings.item_attempts  # runs of an item that raises before its job sees the error
        self._execute = execute
        self._versions = versions
        self._available = available  # is the actor group up? (call pump() when it comes back)
        self._running: dict[str, tuple[TrainingItem, asyncio.Task]] = {}
        self._waiters: dict[str, asyncio.Future] = {}
        self._freed: dict[str, asyncio.Event] = {}
        self.retried_lost = 0  # items re-run because their actor rank was lost
        self.retried_errors = 0
        self.item_s: dict[str, float] = {}  # tenant -> running mean of its items' run time (a control signal)

    # -- producers ------------------------------------------------------------------------------
    async def reserve(self, tenant: str) -> None:
        """Wait for an admission slot of ``tenant`` and take it."""
        while not self.queue.reserve(tenant):
            await self.until_freed(tenant)

    async def submit(self, item: TrainingItem) -> dict[str, Any]:
        """Enqueue an item whose admission slot is reserved; resolves with the update's result.

        Cancelling the caller takes a still-queued item out (its slot is freed); a running item finishes
        and frees its slot then, its result unread."""
        self.queue.put(item)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[item.item_id] = waiter
        self.pump()
        try:
            return await waiter
        except asyncio.CancelledError:
            self._waiters.pop(item.item_id, None)
            if item.tenant in self.queue.limits and self.queue.remove(item):
                self._notify_freed(item.tenant)
            raise

    async def until_freed(self, tenant: str) -> None:
        ev = self._freed.setdefault(tenant, asyncio.Event())
        await ev.wait()

    def apply(self, config: ServiceConfig) -> None:
        """A new scheduler: its ``dispatch.max_concurrent_updates`` from the next dispatch on."""
        self.max_concurrent = config.dispatch.max_concurrent_updates

    # -- the actor group's availability -------------------------------------------------------------
    @property
    def available(self) -> bool:
        """False while the actor group is lost or rebuilding: nothing new is dispatched."""
        return self._available()

    @property
    def running(self) -> list[TrainingItem]:
        return [item for item, _ in self._running.values()]

    def pump(self) -> None:
        """Dispatch queued items while the policy allows and the actor group is up."""
        with self.queue.times.time("pump"):
            self._pump()

    def _pump(self) -> None:
        while self._available() and len(self._running) < self.max_concurrent:
            versions = self._versions()
            item, dropped = self.queue.pop(versions)
            for d in dropped:
                self._resolve(d, {"dropped": True, "lag": versions.get(d.tenant, 0) - d.policy_version})
                self._notify_freed(d.tenant)
            if item is None:
                return
            task = asyncio.get_running_loop().create_task(self._run(item))
            self._running[item.item_id] = (item, task)

    async def _run(self, item: TrainingItem) -> None:
        requeued = False
        t0 = time.monotonic()
        try:
            res = await self._execute(item)
            took, mean = time.monotonic() - t0, self.item_s.get(item.tenant)
            self.item_s[item.tenant] = took if mean is None else 0.7 * mean + 0.3 * took
        except RoleLost as e:  # the actor rank died under it: run it again after the rebuild
            logger.warning("item %s: %s; re-queued", item.item_id, e)
            self.retried_lost += 1
            requeued = self._requeue(item)
        except asyncio.CancelledError:
            self._resolve(item, asyncio.CancelledError())
            raise
        except Exception as e:
            item.attempts += 1
            if item.attempts < self.item_attempts and item.item_id in self._waiters:
                logger.warning("item %s raised %s (attempt %d); retried", item.item_id, e, item.attempts)
                self.retried_errors += 1
                requeued = self._requeue(item)
            else:
                self._resolve(item, e)
        else:
            self._resolve(item, res)
        finally:
            self._running.pop(item.item_id, None)
            if not requeued:
                if item.tenant in self.queue.limits:
                    self.queue.done(item)
                self._notify_freed(item.tenant)
            self.pump()

    def _requeue(self, item: TrainingItem) -> bool:
        if item.tenant not in self.queue.limits or item.item_id not in self._waiters:
            return False  # tenant deleted or job gone: nobody waits for it
        self.queue.requeue(item)
        return True

    def _resolve(self, item: TrainingItem, res: dict[str, Any] | BaseException) -> None:
        w = self._waiters.pop(item.item_id, None)
        if w is not None and not w.done():
            if isinstance(res, asyncio.CancelledError):
                w.cancel()
            elif isinstance(res, BaseException):
                w.set_exception(res)
            else:
                w.set_result(res)

    def _notify_freed(self, tenant: str) -> None:
        ev = self._freed.pop(tenant, None)
        if ev is not None:
            ev.set()

    def notify_freed(self, tenant: str) -> None:
        """A slot of ``tenant`` came back outside the dispatcher (a cancelled reservation)."""
        self._notify_freed(tenant)

    def drop_tenant(self, tenant: str, error: BaseException) -> None:
        """The tenant is being deleted: its queued items leave the queue and their callers get ``error``."""
        for item in self.queue.remove_tenant(tenant):
            self._resolve(item, error)
        for item, _ in list(self._running.values()):
            if item.tenant == tenant:
                self._resolve(item, error)
        self._notify_freed(tenant)

    async def close(self) -> None:
        for _, task in list(self._running.values()):
            task.cancel()
