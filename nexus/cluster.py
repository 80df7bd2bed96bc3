"""The embedded default deployment: a local Dask cluster of separate processes.

* scheduler: ``dask scheduler --preload nexus.control.plugin`` (Master + queues, no torch)
* ``sim-i``: simulator workers, resource ``SIM=1`` each (one simulator process per core)
* ``actor-0``: the training model service, resource ``ACTOR=1``
* ``infer-i``: inference engines (and the MLflow tracker), resource ``INFER=1`` each
  (``n_infer``, default ``inference_engines``; spare ones let ``scale_inference`` grow the pool)

Every worker preloads ``nexus.services.worker_plugin`` (its per-process state and Nexus handlers)
and runs under a nanny, which restarts its process if it dies (the control plane then rebuilds the
roles it hosted).

Every process gets the service config through ``NEXUS_SERVICE_CONFIG`` and one torch thread.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nexus.config import ENV_VAR, ServiceConfig

_DIST_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def _die_with_parent() -> None:
    """Linux: a service process gets SIGTERM when the process that started it dies, however it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class LocalService:
    def __init__(self, config: ServiceConfig, n_sim: int = 2, dashboard_address: str = "127.0.0.1:0",
                 memory_limit: str = "6GiB", n_infer: int | None = None) -> None:
        self.config = config
        self.n_sim = n_sim
        self.n_infer = max(config.inference_engines, 1) if n_infer is None else n_infer
        self.dashboard_address = dashboard_address
        self.memory_limit = memory_limit
        self.root = Path(config.root).resolve()
        self.procs: list[subprocess.Popen] = []
        self.address: str | None = None

    @property
    def scheduler_file(self) -> Path:
        return self.root / "scheduler.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def _env(self) -> dict[str, str]:
        # a torch.distributed set-up of the calling process (its rendezvous port) must not leak into
        # the actor, which starts its own
        env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
        env.update({ENV_VAR: str(self.root / "service.json"), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                    "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", "MLFLOW_ENABLE_ASYNC_LOGGING": "false"})
        return env

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 (kept open for the child's lifetime)
        self.procs.append(subprocess.Popen([sys.executable, "-m", *args], env={**self._env(), **(env or {})},
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                           cwd=self.root, preexec_fn=_die_with_parent))

    def _worker(self, name: str, resources: str) -> None:
        # simulator workers may run vector envs with a process per sub-env: Dask's daemonic worker
        # processes could not start them
        env = {"DASK_DISTRIBUTED__WORKER__DAEMON": "False"} if resources.startswith("SIM") else None
        self._spawn(name, ["distributed.cli.dask_worker", "--scheduler-file", str(self.scheduler_file),
                           "--name", name, "--nthreads", "1", "--resources", resources, "--no-dashboard",
                           "--memory-limit", self.memory_limit, "--death-timeout", "60",
                           "--preload", "nexus.services.worker_plugin"], env)

    def start(self, timeout: float = 120) -> LocalService:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.config.save(self.root / "service.json")
        self.scheduler_file.unlink(missing_ok=True)
        self._spawn("scheduler", ["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
                                  "--dashboard-address", self.dashboard_address,
                                  "--scheduler-file", str(self.scheduler_file),
                                  "--preload", "nexus.control.plugin"])
        t0 = time.time()
        while not self.scheduler_file.exists():
            if self.procs[0].poll() is not None or time.time() - t0 > timeout:
                self.stop()
                raise RuntimeError(f"the scheduler did not start; see {self.logs / 'scheduler.log'}")
            time.sleep(0.1)
        self.address = json.loads(self.scheduler_file.read_text())["address"]
        for i in range(self.n_sim):
            self._worker(f"sim-{i}", "SIM=1")
        self._worker("actor-0", "ACTOR=1")
        for i in range(self.n_infer):
            self._worker(f"infer-{i}", "INFER=1")
        return self

    @property
    def n_workers(self) -> int:
        return self.n_sim + 1 + self.n_infer

    def stop(self) -> None:
        for p in reversed(self.procs):  # workers first, scheduler last
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()

    def __enter__(self) -> LocalService:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
