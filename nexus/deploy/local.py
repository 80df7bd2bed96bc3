"""The embedded default deployment: a local Dask cluster of separate processes.

* scheduler: ``dask scheduler --preload nexus.control.plugin`` (Master + queues, no torch)
* ``sim-i``: simulator workers, resource ``SIM=1`` each (one simulator process per core)
* ``actor-0`` .. ``actor-{N-1}``: the training model service's ranks (``actor_ranks = N``), resource
  ``ACTOR=1`` each; the control plane forms one torch.distributed group over them
* ``infer-i``: inference engines (and the MLflow tracker), resource ``INFER=1`` each
  (``n_infer``, default ``inference_engines``; spare ones let ``scale_inference`` grow the pool)
* ``tracker-0``: with ``cluster.tracker_worker``, the MLflow tracker's own
  worker, resource ``TRACK=1``, at a lower CPU priority than the devices' workers
* ``gateway``: the tenant gateway (``python -m nexus.gateway``), the only door tenants use

Every worker preloads ``nexus.worker.plugin`` (its per-process state and Nexus handlers)
and runs under a nanny, which restarts its process if it dies (the control plane then rebuilds the
roles it hosted).

The command lines are :mod:`nexus.deploy.processes` (the same as the separate-host commands of
:mod:`nexus.deploy.hosts`): the scheduler's plugin gets the service config as its preload argument
(``--nexus-config``), the gateway as ``--config``; every process gets one torch thread. Every
listener — scheduler, dashboard, nannies, workers' comm ports and HTTP servers, torch.distributed,
the gateway — binds to ``ServiceConfig.host`` (127.0.0.1 by default); with ``ServiceConfig.tls`` every
Dask connection is mutual TLS with certificates generated into ``root/tls`` (``nexus.deploy.tls``). Service
processes run with umask 077: what they write is the service user's only.

A running service holds an exclusive lock on ``<root>/service.lock`` (``flock``, released by the kernel
however the process ends): a second service on the same root is refused before it touches anything,
so it can never replace or delete the first one's ``scheduler.json``.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nexus.config.paths import FILE_MODE, harden_process, private_mkdir
from nexus.config.service import ServiceConfig
from nexus.deploy.processes import gateway_command, role_env, role_of, scheduler_command, service_env, worker_command
from nexus.deploy.tls import ensure_certificates, security
from nexus.errors import Conflict, NotFound
from nexus.gateway.auth import read_gateway_url, read_operator_token
from nexus.wire.engine_client import EngineClient, EngineHandle
from nexus.wire.messages import EngineEndpoint


def _cert_hosts(host: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys((host, "127.0.0.1", "localhost")))


def _die_with_parent() -> None:
    """Linux: a service process gets SIGTERM when the process that started it dies, however it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


LOCK_FILE = "service.lock"


def lock_holder(root: str | Path) -> dict | None:
    """Who holds a service root: the lock file's record (pid, scheduler address) if a live process holds
    the lock, else None."""
    path = Path(root) / LOCK_FILE
    if not path.exists():
        return None
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return json.loads(path.read_text() or "{}")
            except json.JSONDecodeError:
                return {}
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


class RootLock:
    """An exclusive, non-blocking lock on a service root, held for the service's lifetime."""

    def __init__(self, root: Path) -> None:
        self.path = root / LOCK_FILE
        self._f = None

    def acquire(self) -> None:
        private_mkdir(self.path.parent)
        f = os.fdopen(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE), "r+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            holder = lock_holder(self.path.parent) or {}
            raise Conflict(f"service root {self.path.parent} is in use by a running service (pid "
                           f"{holder.get('pid', '?')}, scheduler {holder.get('address', '?')}); stop it with "
                           f"`nexus down --root {self.path.parent}` or choose another root") from None
        self._f = f
        self.record()

    def fileno(self) -> int:
        """The locked file's descriptor (kept open across ``exec`` by ``nexus scheduler``: the lock goes with it)."""
        if self._f is None:
            raise RuntimeError("the root lock is not held")
        return self._f.fileno()

    def record(self, **fields) -> None:
        if self._f is not None:
            self._f.seek(0)
            self._f.truncate()
            self._f.write(json.dumps({"pid": os.getpid(), **fields}))
            self._f.flush()

    def release(self) -> None:
        if self._f is not None:
            self._f.seek(0)
            self._f.truncate()
            fcntl.flock(self._f, fcntl.LOCK_UN)
            self._f.close()
            self._f = None


def _scheduler_address(path: Path) -> str | None:
    """The address in a scheduler file, or None while it is missing or still being written."""
    try:
        return str(json.loads(path.read_text())["address"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def _child_setup() -> None:
    _die_with_parent()
    harden_process()


class InternalAccess:
    """The service-internal Dask connection, for the process that started the service only (its operator, tests):
    scheduler handlers by name, the inference engines directly. Tenants, the Python client and the CLI reach
    the service through the gateway (``nexus.client.api.Nexus``); nothing here is part of that contract."""

    address: str | None
    config: ServiceConfig
    _client: Any = None
    _predictor: Any = None

    @property
    def client(self):
        """The Dask client of the service's scheduler (made on first use, closed with the service)."""
        if self._client is None:
            if self.address is None:
                raise Conflict("the service is not running: no Dask connection")
            from distributed import Client

            self._client = Client(self.address, timeout=60, set_as_default=False, security=security(self.config))
        return self._client

    def internal(self, handler: str, **kwargs: Any) -> Any:
        """A scheduler handler (``nexus_status``, ``nexus_env_sessions``, …) over the Dask connection."""
        return self.client.sync(getattr(self.client.scheduler, handler), **kwargs)

    def engine(self, index: int = 0):
        """The ``index``-th serving inference engine (``engine(0).engine_stats().result()``)."""
        engines = self.internal("nexus_engines")
        if index >= len(engines):
            raise NotFound(f"no inference engine {index}: {len(engines)} serve")
        return EngineHandle(self.client, EngineEndpoint.from_dict(engines[index]))

    def predictor(self):
        """Action requests straight to each tenant's engine (re-routed when an engine drains or is lost)."""
        if self._predictor is None:
            self._predictor = EngineClient(self.client)
        return self._predictor

    @property
    def dashboard_link(self) -> str:
        return self.client.dashboard_link

    def close_client(self, timeout: float | None = None) -> None:
        client, self._client, self._predictor = self._client, None, None
        if client is not None:
            client.close(timeout=timeout) if timeout is not None else client.close()


class LocalService(InternalAccess):
    def __init__(self, config: ServiceConfig, n_sim: int | None = None, dashboard_address: str | None = None,
                 memory_limit: str | None = None, n_infer: int | None = None, *,
                 slots: dict[str, int] | None = None, devices: dict[str, int] | None = None,
                 env: dict[str, str] | None = None, preload: tuple[str, ...] = ()) -> None:
        """``slots``: per role, its resource count and threads in each worker (default 1); ``devices``: per role,
        the devices each worker holds (default 1: a worker is one device); ``env``: more environment for every
        process; ``preload``: more modules every worker preloads (``processes.worker_command``)."""
        self.config = config
        self.n_sim = n_sim or config.cluster.sim_workers
        self.n_infer = max(config.inference_engines, 1) if n_infer is None else n_infer
        self.slots = {"sim": 1, "actor": 1, "infer": 1, "tracker": 1, **(slots or {})}
        self.devices = {"sim": 1, "actor": 1, "infer": 1, "tracker": 1, **(devices or {})}
        self.extra_env = dict(env or {})
        self.preload = tuple(preload)
        self.dashboard_address = dashboard_address or config.cluster.dashboard_address or f"{config.host}:0"
        self.memory_limit = memory_limit or config.cluster.memory_limit
        self.root = Path(config.root).resolve()
        self.procs: list[subprocess.Popen] = []
        self.names: dict[int, str] = {}  # pid of a spawned process -> its name (scheduler, gateway, sim-0, ...)
        self.address: str | None = None
        self.gateway_url: str | None = None
        self.tls = None  # TLSFiles once started with config.tls
        self._lock = RootLock(self.root)

    @property
    def operator_token(self) -> str:
        """The gateway's operator token (admin calls), written 0600 under the root at start."""

        return read_operator_token(self.config.gateway_dir)

    @property
    def scheduler_file(self) -> Path:
        return self.root / "scheduler.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def _env(self) -> dict[str, str]:
        return {**service_env(self.config), **self.extra_env}

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        fd = os.open(self.logs / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        log = os.fdopen(fd, "w")  # kept open for the child's lifetime
        self.procs.append(subprocess.Popen([sys.executable, "-m", *args], env={**self._env(), **(env or {})},
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                           cwd=self.root, preexec_fn=_child_setup))
        self.names[self.procs[-1].pid] = name

    def _worker(self, name: str, resources: str) -> None:
        role = role_of(resources)
        self._spawn(name, worker_command(self.scheduler_file, name, role, self.config.host, self.memory_limit,
                                         self.tls, slots=self.slots[role], devices=self.devices[role],
                                         preload=self.preload),
                    role_env(role) or None)

    def _gateway(self) -> None:
        (self.config.gateway_dir / "gateway.json").unlink(missing_ok=True)
        self._spawn("gateway", gateway_command(self.root / "service.json"))

    def _wait_gateway(self, t0: float, timeout: float) -> None:

        gw = self.procs[-1] if self.procs else None
        while True:
            url = read_gateway_url(self.config.gateway_dir)
            if url:
                self.gateway_url = url
                return
            if gw is None or gw.poll() is not None or time.time() - t0 > timeout:
                self.stop()
                raise RuntimeError(f"the gateway did not start; see {self.logs / 'gateway.log'}")
            time.sleep(0.1)

    def start(self, timeout: float = 120) -> LocalService:
        private_mkdir(self.root)
        os.chmod(self.root, 0o700)
        self._lock.acquire()  # before anything in the root changes
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> LocalService:
        private_mkdir(self.logs)
        if self.config.tls:
            self.tls = ensure_certificates(self.config.tls_dir, hosts=_cert_hosts(self.config.host))
        self.config.save(self.root / "service.json")
        self.scheduler_file.unlink(missing_ok=True)  # a stale one: the lock says no live service owns it
        self._spawn("scheduler", scheduler_command(self.root / "service.json", self.scheduler_file, self.config.host,
                                                   0, self.dashboard_address, self.tls))
        t0 = time.time()
        while (address := _scheduler_address(self.scheduler_file)) is None:  # Dask writes the file non-atomically
            if self.procs[0].poll() is not None or time.time() - t0 > timeout:
                raise RuntimeError(f"the scheduler did not start; see {self.logs / 'scheduler.log'}")
            time.sleep(0.1)
        self.address = address
        self._lock.record(address=self.address)
        for i in range(self.n_sim):
            self._worker(f"sim-{i}", "SIM=1")
        for rank in range(self.config.actor_ranks):
            self._worker(f"actor-{rank}", "ACTOR=1")
        for i in range(self.n_infer):
            self._worker(f"infer-{i}", "INFER=1")
        if self.config.resolved_tracker_worker():
            self._worker("tracker-0", "TRACK=1")
        self._gateway()
        self._wait_gateway(t0, timeout)
        return self

    @property
    def n_workers(self) -> int:
        return self.n_sim + self.config.actor_ranks + self.n_infer + int(self.config.resolved_tracker_worker())

    def stop(self) -> None:
        self.close_client()
        self._end_sessions()
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
        if self.procs:  # only the service that started the scheduler removes its file
            self.scheduler_file.unlink(missing_ok=True)
        self.procs.clear()
        self.names.clear()
        self._lock.release()

    def _end_sessions(self, timeout: float = 15.0) -> None:
        """While the tracker still runs: end the MLflow runs of the low-level op sessions (FINISHED, not
        left RUNNING for the next start to mark failed). Best effort, bounded: a dead scheduler is skipped."""
        if not self.procs or self.address is None or self.procs[0].poll() is not None:
            return
        import asyncio
        import threading


        async def call() -> None:
            from distributed.core import rpc

            sec = security(self.config)
            r = rpc(self.address, timeout=5, connection_args=sec.get_connection_args("client") if sec else {})
            try:
                await asyncio.wait_for(r.nexus_end_sessions(timeout=timeout), 2 * timeout + 5)  # settle + flush
            finally:
                await r.close_rpc()

        def run() -> None:  # its own event loop: stop() may be called from async code
            try:
                asyncio.run(call())
            except Exception as e:
                print(f"ending the op sessions' MLflow runs: {type(e).__name__}: {e}", file=sys.stderr)

        t = threading.Thread(target=run, daemon=True, name="nexus-end-sessions")
        t.start()
        t.join(2 * timeout + 10)

    def listening(self) -> list[tuple[int, str, str, int]]:
        """(pid, process, ip, port) of every listening socket of the service's processes (and children)."""
        import psutil

        out = []
        for p in self.procs:
            try:
                root = psutil.Process(p.pid)
                family = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for q in family:
                try:
                    conns = q.net_connections(kind="inet")
                    name = " ".join(q.cmdline()[1:4])
                except psutil.NoSuchProcess:
                    continue
                for c in conns:
                    if c.status == psutil.CONN_LISTEN or (c.type == 2 and not c.raddr):  # TCP listen, UDP bound
                        out.append((q.pid, name, c.laddr.ip, c.laddr.port))
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) the service's processes used so far, by name: ``scheduler``, ``gateway``,
        each worker with its children (``actor-0``, ``infer-0``, ``sim-0``, ...) and ``nannies`` (the
        process a worker runs under). Benchmarks read it around a run."""
        import psutil

        out: dict[str, float] = {}
        for p in self.procs:
            name = self.names[p.pid]
            try:
                root = psutil.Process(p.pid)
                parts = [(root, name), *((q, name) for q in root.children(recursive=True))]
            except psutil.NoSuchProcess:
                continue
            if name not in ("scheduler", "gateway"):  # a worker's spawned process is its nanny
                parts[0] = (root, "nannies")
            for q, role in parts:
                try:
                    t = q.cpu_times()
                except psutil.NoSuchProcess:  # ended in between
                    continue
                out[role] = out.get(role, 0.0) + t.user + t.system
        return out

    def __enter__(self) -> LocalService:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
