"""The actor group: N ranks of the Training Model Service (workers with resource ``ACTOR``).

Every tenant has a slot on every rank, and DeepSpeed's steps and checkpoints are collective, so
each unit of actor work is one task per rank, pinned to that rank's worker, and the result is rank
0's. The group is *ready* once every rank has rebuilt its slots; when a rank's worker is lost, the
group stops being ready, the tasks it holds are cancelled and their callers get ``RoleLost`` (the
dispatcher re-queues the item; idempotent calls are retried here), and the supervisor rebuilds
the group on the restarted workers. Only ``N = 1`` is exercised so far.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nexus.control import tasks
from nexus.control.queues import TrainingItem
from nexus.control.runtime import DaskRuntime
from nexus.control.tasks import TaskRef
from nexus.errors import RoleLost, Unavailable
from nexus.messages import EAGER, EngineEndpoint, TenantSetup, UpdateRequest, UpdateResult


@dataclass
class _Call:
    futures: list = field(default_factory=list)
    lost: bool = False


def _cancelling() -> bool:
    task = asyncio.current_task()
    return bool(task is not None and task.cancelling())


class ActorGroup:
    def __init__(self, runtime: DaskRuntime, world_size: int = 1) -> None:
        self.runtime = runtime
        self.world_size = world_size
        self.addresses: list[str] = []
        self.workers: list[str] = []
        self.epoch = 0
        self.unavailable_reason: str | None = None  # set when the group cannot come back (budget spent)
        self._ready = asyncio.Event()
        self._changed = asyncio.Event()
        self._inflight: set[int] = set()
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count()
        self._attempts = itertools.count()

    @property
    def roles(self) -> list[str]:
        return [f"actor/{r}" for r in range(self.world_size)]

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def set_ready(self, addresses: list[str], workers: list[str]) -> None:
        self.addresses, self.workers = list(addresses), list(workers)
        self.epoch += 1
        self.unavailable_reason = None
        self._ready.set()
        self._notify()

    def set_unavailable(self, reason: str) -> None:
        self.unavailable_reason = reason
        self._notify()

    def lost(self, address: str) -> bool:
        """A worker left: if it held a rank, the group is down and its in-flight work is cancelled."""
        if address not in self.addresses:
            return False
        self._ready.clear()
        self.addresses = []
        for call in self._calls.values():
            call.lost = True
            self.runtime.cancel(call.futures)
        self._notify()
        return True

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_ready(self, timeout: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._ready.is_set():
            if self.unavailable_reason:
                raise Unavailable(f"the actor group is down: {self.unavailable_reason}")
            ev = self._changed
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                raise Unavailable(f"the actor group was not ready within {timeout:g} s")
            try:
                await asyncio.wait_for(ev.wait(), left)
            except TimeoutError:
                pass

    async def run(self, task: TaskRef, args: Callable[[int], tuple], key: str, *, retry_lost: bool = False,
                  timeout: float | None = None) -> Any:
        """Run ``task(*args(rank))`` on every rank; rank 0's result.

        Raises ``RoleLost`` if a rank was lost meanwhile (``retry_lost``: run again once rebuilt)."""
        while True:
            await self.wait_ready(timeout)
            try:
                return await self.run_on(self.addresses, task, args, key)
            except RoleLost:
                if not retry_lost:
                    raise

    async def update(self, item: TrainingItem, setup: TenantSetup,
                     engines: tuple[EngineEndpoint, ...]) -> UpdateResult:
        """Run one training-queue item on every rank (``nexus.services.actor_tasks.run_update``); its new
        version goes to ``engines``. ``RoleLost`` if a rank was lost meanwhile (the dispatcher re-queues)."""
        def request(rank: int) -> tuple:
            return (UpdateRequest(item.item_id, item.job, item.work, setup, engines, item.sync or EAGER, rank,
                                  self.world_size), item.data)

        return await self.run(tasks.RUN_UPDATE, request, key=f"nexus-update-{item.item_id}")

    async def run_on(self, addresses: list[str], task: TaskRef, args: Callable[[int], tuple], key: str) -> Any:
        """Run on the given rank workers now (the rebuild uses this before the group is ready)."""
        attempt = next(self._attempts)
        call_id = next(self._ids)
        call = self._calls[call_id] = _Call()
        try:
            for rank, address in enumerate(addresses):
                k = f"{key}-a{attempt}" + (f"-rank{rank}" if rank else "")
                call.futures.append(await self.runtime.submit(task, *args(rank), key=k, workers=[address]))
            if call.lost:
                raise RoleLost(f"an actor rank was lost before {key} started")
            results = await self.runtime.gather(call.futures)
            return results[0]
        except BaseException as e:
            if call.lost and not _cancelling():
                raise RoleLost(f"an actor rank was lost during {key}") from e
            if isinstance(e, asyncio.CancelledError):
                self.runtime.cancel(call.futures)
            raise
        finally:
            del self._calls[call_id]
