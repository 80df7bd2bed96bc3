"""The actor group: N ranks of the Training Model Service (workers with resource ``ACTOR``), one
torch.distributed group (``nexus.actor.process_group``).

Every tenant has a slot on every rank, and DeepSpeed's steps and checkpoints are collective, so
each unit of actor work is one task per rank, pinned to that rank's worker, and the result is rank
0's (file-only tasks run on rank 0 alone: ``first_only``). With N > 1 ranks one call runs at a time,
so every rank runs the same tasks in the same order (collectives must match). The group is *ready*
once every rank has rebuilt its slots; when a rank's worker is lost, the group stops being ready,
the tasks it holds are cancelled and their callers get ``RoleLost`` (the dispatcher re-queues the
item; idempotent calls are retried here), and the supervisor rebuilds the group: with N > 1 on
fresh processes for every rank (:attr:`ActorGroup.stale` lists the survivors to restart: their
process group is broken). Ranks whose outcomes of one call differ (one failed, another did not, or
they failed differently) have left the group inconsistent: it is rebuilt the same way.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nexus.control import tasks
from nexus.control.dispatch.training_queue import TrainingItem
from nexus.control.runtime import DaskRuntime
from nexus.control.tasks import TaskRef
from nexus.errors import RoleLost, Unavailable
from nexus.wire.messages import EAGER, EngineEndpoint, TenantSetup, UpdateRequest, UpdateResult


@dataclass
class _Call:
    futures: list = field(default_factory=list)
    lost: bool = False


AGREE_S = 10.0  # how long the other ranks get to fail the same way once one rank failed


def _error(wait: asyncio.Future) -> BaseException | None:
    if not wait.done():
        return None
    return asyncio.CancelledError() if wait.cancelled() else wait.exception()


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
        self._serial = asyncio.Lock()  # N > 1: one call at a time, in the same order on every rank
        self.stale: list[str] = []  # N > 1: workers whose process still holds a broken group (to restart)
        self.broken_reason: str | None = None

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
        self._down([a for a in self.addresses if a != address], f"rank {self.addresses.index(address)} lost")
        return True

    def broken(self, reason: str) -> None:
        """The ranks disagree: the group is down and rebuilt on fresh processes of every rank."""
        if self.addresses:
            self._down(list(self.addresses), reason)

    def _down(self, survivors: list[str], reason: str) -> None:
        self._ready.clear()
        if self.world_size > 1:
            self.stale = sorted(set(self.stale) | set(survivors))
        self.broken_reason = reason
        self.addresses = []
        for call in self._calls.values():
            call.lost = True
            self.runtime.cancel(call.futures)
        self._notify()

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
                  timeout: float | None = None, first_only: bool = False) -> Any:
        """Run ``task(*args(rank))`` on every rank (``first_only``: on rank 0 alone: a task that only reads or
        writes files); rank 0's result.

        Raises ``RoleLost`` if a rank was lost meanwhile (``retry_lost``: run again once rebuilt)."""
        while True:
            await self.wait_ready(timeout)
            try:
                return await self.run_on(self.addresses[:1] if first_only else self.addresses, task, args, key)
            except RoleLost:
                if not retry_lost:
                    raise

    async def update(self, item: TrainingItem, setup: TenantSetup,
                     engines: tuple[EngineEndpoint, ...]) -> UpdateResult:
        """Run one training-queue item on every rank (``nexus.actor.tasks.run_update``); its new
        version goes to ``engines``. ``RoleLost`` if a rank was lost meanwhile (the dispatcher re-queues)."""
        def request(rank: int) -> tuple:
            return (UpdateRequest(item.item_id, item.job, item.work, setup, engines, item.sync or EAGER, rank,
                                  self.world_size), item.data)

        return await self.run(tasks.RUN_UPDATE, request, key=f"nexus-update-{item.item_id}")

    async def run_on(self, addresses: list[str], task: TaskRef, args: Callable[[int], tuple], key: str) -> Any:
        """Run on the given rank workers now (the rebuild uses this before the group is ready)."""
        if self.world_size == 1:
            return await self._run_on(addresses, task, args, key)
        async with self._serial:
            return await self._run_on(addresses, task, args, key)

    async def _run_on(self, addresses: list[str], task: TaskRef, args: Callable[[int], tuple], key: str) -> Any:
        attempt = next(self._attempts)
        call_id = next(self._ids)
        call = self._calls[call_id] = _Call()
        try:
            for rank, address in enumerate(addresses):
                k = f"{key}-a{attempt}" + (f"-rank{rank}" if rank else "")
                call.futures.append(await self.runtime.submit(task, *args(rank), key=k, workers=[address]))
            if call.lost:
                raise RoleLost(f"an actor rank was lost before {key} started")
            if len(call.futures) == 1:
                return (await self.runtime.gather(call.futures))[0]
            return await self._agreed(call.futures, key)
        except BaseException as e:
            if call.lost and not _cancelling() and not isinstance(e, RoleLost):
                raise RoleLost(f"an actor rank was lost during {key}") from e
            if isinstance(e, asyncio.CancelledError):
                self.runtime.cancel(call.futures)
            raise
        finally:
            del self._calls[call_id]

    async def _agreed(self, futures: list, key: str) -> Any:
        """Rank 0's result when every rank succeeded; the error when every rank raised the same one (the ranks
        compare outcomes before their collectives); otherwise the group is broken (``RoleLost``)."""
        waits = [asyncio.ensure_future(self.runtime.gather([f])) for f in futures]
        try:
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
            if pending:  # one rank failed: the others fail the same way at once, or they are stuck
                await asyncio.wait(pending, timeout=AGREE_S)
            errors = [_error(w) for w in waits]
            if not any(errors):
                return waits[0].result()[0]
            kinds = {(type(e).__name__, str(e)) if e is not None else None for e in errors}
            if len(kinds) == 1 and all(w.done() for w in waits):
                raise errors[0]  # type: ignore[misc]
            reason = f"the ranks disagreed on {key}: " + "; ".join(
                f"rank {r}: " + (f"{type(e).__name__}: {e}" if e is not None else "ok" if w.done() else "running")
                for r, (w, e) in enumerate(zip(waits, errors, strict=True)))
            self.broken(reason[:500])
            raise RoleLost(reason[:500])
        finally:
            for w in waits:
                w.cancel()
