"""The service's MLflow tracker, hosted by one worker (an ``INFER`` worker, as in the paper's layout): its
calls run one after another in its own thread, consecutive metric writes batched per MLflow run."""

from __future__ import annotations

import asyncio
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nexus.config.service import ServiceConfig
from nexus.tracking.tracker import Tracker

logger = logging.getLogger("nexus.worker")


class TrackerHost:
    METHODS = frozenset({"start_run", "log_metrics", "end_run", "flush", "reopen", "fail_interrupted"})

    def __init__(self, config: ServiceConfig | dict[str, Any]) -> None:
        self.tracker = Tracker(config)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="nexus-tracker")
        self.warmed = self._thread.submit(self._warm)  # first in the thread: the calls queue behind it

    def _warm(self) -> bool:
        try:
            self.tracker.warm()
            return True
        except Exception as e:  # the first call that needs the store tries again (and reports its failure)
            logger.warning("tracker warm-up failed: %s", e)
            return False

    async def run(self, calls: list[list[Any]]) -> list[Any]:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._run_all, calls)

    def _run_all(self, calls: list[list[Any]]) -> list[Any]:
        """The calls in order; each run of consecutive ``log_metrics`` is one write per MLflow run."""
        out: list[Any] = []
        for method, group in itertools.groupby(calls, key=lambda c: c[0]):
            group = list(group)
            if method == "log_metrics":
                self._call("log_metrics_many", {"rows": [kw for _, kw in group]})
                out += [None] * len(group)
            else:
                out += [self._call(method, kw) if method in self.METHODS else None for _, kw in group]
        return out

    def _call(self, method: str, kwargs: dict[str, Any]) -> Any:
        try:
            return getattr(self.tracker, method)(**kwargs)
        except Exception as e:  # one bad call must not lose the batch
            logger.error("tracker %s failed: %s", method, e)
            return None
