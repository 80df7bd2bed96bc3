"""An actor group of N ranks on a real Dask cluster of worker processes, driven by the real actor tasks
(``nexus.control.tasks``) the way the control plane drives them: a rendezvous on rank 0's worker, every rank
started at once, then each call one task per rank, all gathered before the next (``ActorGroup``'s order).
No scheduler plugin: the tests and the benchmark give the same requests to a 1-rank and an N-rank group.
"""

from __future__ import annotations

import time
from typing import Any

from distributed import Client, LocalCluster
from distributed.comm import get_address_host

from nexus.config.service import ServiceConfig
from nexus.control import tasks
from nexus.control.health.actor_placement import local_ranks
from nexus.wire.messages import Rendezvous
from nexus.worker.plugin import slot_states


class RankGroup:
    def __init__(self, config: ServiceConfig, ranks: int) -> None:
        self.config, self.ranks = config, ranks
        self.cluster: LocalCluster | None = None
        self.client: Client | None = None
        self.addresses: list[str] = []
        self._calls = 0

    def start(self) -> RankGroup:
        host = self.config.host
        self.cluster = LocalCluster(n_workers=self.ranks, threads_per_worker=1, processes=True, host=host,
                                    dashboard_address=f"{host}:0", resources={"ACTOR": 1}, memory_limit="4GiB",
                                    env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
        self.client = Client(self.cluster)
        workers = self.client.scheduler_info(n_workers=-1)["workers"]
        self.addresses = sorted(workers, key=lambda a: str(workers[a]["name"]))
        if self.ranks == 1:
            self._all(tasks.START_ACTOR, lambda r: (self.config, 0, 1))
        else:
            port = self.client.submit(tasks.OPEN_RENDEZVOUS, workers=[self.addresses[0]], pure=False).result()
            rv = Rendezvous(get_address_host(self.addresses[0]), int(port), self.ranks, 1)
            local = local_ranks(self.addresses)
            self._all(tasks.START_ACTOR, lambda r: (self.config, r, self.ranks, rv, local[r]))
        return self

    def _all(self, task, args, data: Any = None) -> list[Any]:
        self._calls += 1
        futures = [self.client.submit(task, *args(r), *(() if data is None else (data,)), workers=[a],
                                      allow_other_workers=False, pure=False, key=f"{task.__name__}-{self._calls}-{r}")
                   for r, a in enumerate(self.addresses)]
        return self.client.gather(futures)

    def run(self, task, args=lambda r: (), data: Any = None) -> Any:
        """``task(*args(rank)[, data])`` on every rank; rank 0's result."""
        return self._all(task, args, data)[0]

    def timed(self, task, args=lambda r: (), data: Any = None) -> tuple[Any, float]:
        t0 = time.perf_counter()
        out = self.run(task, args, data)
        return out, time.perf_counter() - t0

    def slot_states(self) -> list[dict[str, dict[str, int]]]:
        """Each rank's ``slot_states`` (version, optimizer bytes, ...), in rank order."""
        states = self.client.run(slot_states)
        return [states[a] for a in self.addresses]

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()

    def __enter__(self) -> RankGroup:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
