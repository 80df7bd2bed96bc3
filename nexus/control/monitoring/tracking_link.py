"""The control plane's ordered, never-blocking link to the MLflow tracker (hosted by a worker).

Calls are queued in order and sent in batches by one sender; the caller never waits. The sender lets
calls gather for a moment (``linger_s``) so that one message carries many, and the tracker writes
each batch's metrics in one store transaction per run. When the
tracker's worker is lost, the unacknowledged batch stays queued; once the supervisor has started a
new tracker (a new epoch), the link first sends ``reopen`` with every run it knows, so the new
tracker continues the same MLflow runs, and then resends. ``start_run`` is idempotent on the tracker
side (it adopts an existing run of the same job), so a batch that was half applied is safe to resend.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("nexus.tracking")

Send = Callable[[str, list[list[Any]]], Awaitable[list[Any]]]  # (address, calls) -> results


class TrackerLink:
    def __init__(self, send: Send, max_batch: int = 200, linger_s: float = 0.5,
                 on_error: Callable[[str], None] | None = None) -> None:
        """``linger_s``: how long the sender lets calls gather before it sends what it has (a batch is one
        message and one tracker write per run however many calls it holds; ``flush`` never lingers)."""
        self._send = send
        self.max_batch = max_batch
        self.linger_s = linger_s
        self._flushing = 0
        self.address: str | None = None
        self.epoch = 0
        self._sent_epoch = 0
        self.runs: dict[str, str] = {}  # job id -> MLflow run id (acknowledged)
        self._pending: deque[list[Any]] = deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self.errors = 0
        self.on_error = on_error

    # -- calls (never wait) -----------------------------------------------------------------------------
    def start_run(self, job_id: str, tenant: str, kind: str, params: dict[str, Any],
                  parent_job: str | None = None, start_time: float | None = None, run_name: str | None = None,
                  tags: dict[str, str] | None = None) -> None:
        # the job's own times (not when the tracker got to the call): a resent batch keeps them
        extra = {k: v for k, v in (("run_name", run_name), ("tags", tags)) if v}
        self._queue("start_run", job_id=job_id, tenant=tenant, kind=kind, params=params, parent_job=parent_job,
                    start_time=start_time, **extra)

    def log_metrics(self, job_id: str, metrics: dict[str, Any], step: int, kind: str = "train") -> None:
        plain = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if plain:
            self._queue("log_metrics", job_id=job_id, metrics=plain, step=int(step), kind=kind)

    def end_run(self, job_id: str, status: str, artifacts: list[str], result: dict[str, Any],
                history: list[dict[str, Any]] | None = None, metering: dict[str, float] | None = None,
                end_time: float | None = None) -> None:
        self._queue("end_run", job_id=job_id, status=status, artifacts=list(artifacts), result=result,
                    history=history, metering=metering, end_time=end_time)

    def fail_interrupted(self, before_ms: int, root: str, reason: str,
                         ended: dict[str, list[Any]] | None = None) -> None:
        """Runs a crashed service left RUNNING: a job whose record says it ended (``ended``: job -> [state,
        t_end]) gets that state, the others FAILED with ``reason``."""
        self._queue("fail_interrupted", before_ms=int(before_ms), root=root, reason=reason, ended=ended or {})

    def _queue(self, method: str, **kwargs: Any) -> None:
        self._pending.append([method, kwargs])
        self._idle.clear()
        self._wake.set()

    # -- placement ---------------------------------------------------------------------------------------
    def attach(self, address: str) -> None:
        """A (new) tracker serves at ``address``: reopen the known runs there, then resend."""
        self.address = address
        self.epoch += 1
        self._wake.set()

    def lost(self) -> None:
        self.address = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._sender())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def flush(self, timeout: float = 60.0) -> bool:
        self._flushing += 1
        self._wake.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self._flushing -= 1

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _in_a_hurry(self) -> bool:
        return bool(self._flushing) or len(self._pending) >= self.max_batch or self.address is None

    async def _linger(self) -> None:
        """Let calls gather for up to ``linger_s``; a flush or a full batch ends the wait at once."""
        deadline = asyncio.get_running_loop().time() + self.linger_s
        while not self._in_a_hurry():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return

    # -- sender --------------------------------------------------------------------------------------------
    async def _sender(self) -> None:
        while True:
            if not self._pending or self.address is None:
                if not self._pending:
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._linger()
            if self.address is None:
                continue
            address, epoch = self.address, self.epoch
            batch = [self._pending[i] for i in range(min(self.max_batch, len(self._pending)))]
            calls = batch if self._sent_epoch == epoch else [["reopen", {"runs": dict(self.runs)}], *batch]
            try:
                results = await self._send(address, calls)
            except Exception as e:
                self.errors += 1
                if self.on_error is not None:
                    self.on_error(f"{type(e).__name__}: {e}")
                logger.info("tracker call failed (%s); will resend", e)
                if self.address == address:  # not re-placed yet: back off a little
                    await asyncio.sleep(1.0)
                continue
            self._sent_epoch = epoch
            results = results[len(calls) - len(batch):]
            for call, res in zip(batch, results, strict=True):
                if call[0] == "start_run" and isinstance(res, str):
                    self.runs[call[1]["job_id"]] = res
            for _ in batch:
                self._pending.popleft()
