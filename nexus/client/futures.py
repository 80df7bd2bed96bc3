"""The client's one future type: every call that does not answer at once returns a :class:`NexusFuture`.

It is a :class:`concurrent.futures.Future` (``result(timeout)``, ``done()``, ``exception()``,
``add_done_callback``) that can also be awaited in asyncio code (``await fut``), like Tinker's futures.
Whatever transport produced it (the HTTP gateway or the service-internal Dask connection), the caller sees the
same type; errors the service reports arrive as :class:`nexus.errors.NexusError` subclasses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from concurrent.futures import Executor, Future
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class NexusFuture(Future, Generic[T]):
    """A future of a service call: ``fut.result(timeout)`` or ``await fut``."""

    def result(self, timeout: float | None = None) -> T:  # typed override
        return super().result(timeout)

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.wrap_future(self).__await__()

    @classmethod
    def run(cls, executor: Executor, fn: Callable[..., T], *args: Any, **kwargs: Any) -> NexusFuture[T]:
        """Run ``fn(*args, **kwargs)`` on ``executor``; its outcome becomes this future's."""
        out: NexusFuture[T] = cls()
        inner = executor.submit(fn, *args, **kwargs)
        inner.add_done_callback(lambda f: _copy(f, out))
        return out

    @classmethod
    def of(cls, src: Future) -> NexusFuture[T]:
        """The same outcome as another transport's ``concurrent.futures.Future``."""
        out: NexusFuture[T] = cls()
        src.add_done_callback(lambda f: _copy(f, out))
        return out

    @classmethod
    def resolved(cls, value: T) -> NexusFuture[T]:
        out: NexusFuture[T] = cls()
        out.set_result(value)
        return out


def _copy(src: Future, dst: Future) -> None:
    if src.cancelled():
        dst.cancel()
    elif src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())
