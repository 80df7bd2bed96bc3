"""The client's one future type: result(), exceptions, await, call order on one executor."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from nexus.client.futures import NexusFuture
from nexus.errors import NotFound


def test_result_error_and_await():
    pool = ThreadPoolExecutor(1)
    order: list[int] = []
    gate = threading.Event()
    first = NexusFuture.run(pool, lambda: (gate.wait(5), order.append(1), "a")[-1])
    second = NexusFuture.run(pool, lambda: order.append(2) or 2)
    failing = NexusFuture.run(pool, lambda: (_ for _ in ()).throw(NotFound("no tenant 'x'")))
    assert isinstance(first, Future) and not first.done()
    gate.set()
    assert first.result(60) == "a" and second.result(60) == 2 and order == [1, 2]  # submission order
    with pytest.raises(NotFound, match="no tenant 'x'"):
        failing.result(60)

    async def waits() -> tuple:
        later = NexusFuture.run(pool, lambda: 7)
        return await later, await NexusFuture.resolved("done")

    assert asyncio.run(waits()) == (7, "done")
    pool.shutdown()
