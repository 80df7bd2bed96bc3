"""Separate hosts, same engine: the scheduler, the gateway and workers by role as commands of their own.

Each host runs one command (``nexus scheduler``, ``nexus gateway``, ``nexus worker --role sim|actor|infer|tracker``),
all pointed at one service root on shared storage; each becomes the process it starts (``exec``: signals,
exit status and logs are the program's own, as a cluster manager expects):

* ``nexus scheduler`` writes the root's ``service.json`` (the one config every process reads), creates the
  certificates under ``root/tls`` (TLS is on by default once the scheduler's address is not loopback; a
  non-loopback service without TLS needs ``--no-tls``), holds the root's lock and starts ``dask scheduler``
  with the Nexus plugin, which writes ``root/scheduler.json``.
* ``nexus worker`` waits for both files, then starts a nannied ``dask worker`` with the role's resource and
  the worker plugin. Its address is ``--host``, by default the one on this host's route to the scheduler;
  ``--scratch`` is its local directory (spill, temporary files) on this host's own disk.
* ``nexus gateway`` waits for both files, then starts the tenant gateway; on a non-loopback address of a TLS
  service it serves HTTPS with a certificate issued by the service CA (clients verify it with
  ``root/tls/ca.pem``).

Workers may join and leave at any time: the control plane places roles on whatever workers have the
resource (:mod:`nexus.control.health.supervisor`).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from nexus.config.paths import harden_process, private_mkdir
from nexus.config.service import ServiceConfig, is_loopback
from nexus.deploy.local import RootLock
from nexus.deploy.processes import (
    ROLE_RESOURCES,
    gateway_command,
    role_env,
    scheduler_command,
    service_env,
    worker_command,
)
from nexus.deploy.tls import ensure_certificates, server_certificate, tls_files
from nexus.errors import SpecError, Unavailable

SCHEDULER_PORT, DASHBOARD_PORT = 8786, 8787  # Dask's own defaults


def facing_address(target: str) -> str:
    """This host's address on the route to ``target`` (a UDP socket's connect sends nothing)."""
    family = socket.AF_INET6 if ":" in target else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((target, 9))
        return s.getsockname()[0]


def address_host(address: str) -> str:
    """``tls://10.0.0.1:8786`` -> ``10.0.0.1`` (``[::1]`` -> ``::1``)."""
    hostport = address.split("://", 1)[-1]
    return hostport.rsplit(":", 1)[0].strip("[]")


@dataclass
class Launch:
    """A service process to become: ``python -m ARGS`` in ``env``, with file descriptors to keep open."""

    args: list[str]
    env: dict[str, str]
    cwd: Path | None = None
    keep_fds: list[int] = field(default_factory=list)

    def exec(self) -> NoReturn:
        harden_process()  # what the service writes is its user's only (umask survives exec)
        for fd in self.keep_fds:
            os.set_inheritable(fd, True)
        if self.cwd is not None:
            os.chdir(self.cwd)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", *self.args], self.env)


# ------------------------------------------------------------------------------------------- scheduler
def plan_scheduler(config: ServiceConfig, port: int = SCHEDULER_PORT, dashboard_address: str | None = None,
                   tls: bool | None = None) -> tuple[Launch, RootLock]:
    """Prepare the root (lock, certificates, ``service.json``) and the scheduler's command line. ``tls``:
    None follows the config, on by default off loopback; False on a non-loopback host is insecure but
    explicit."""
    host = config.host
    use_tls = tls if tls is not None else (config.tls or not is_loopback(host))
    if not use_tls and not is_loopback(host):
        print(f"warning: the service listens on {host} without TLS (--no-tls): anyone who reaches it can run code "
              "on every worker", file=sys.stderr)
    config = config.model_copy(update={"tls": use_tls})
    root = Path(config.root)
    private_mkdir(root)
    os.chmod(root, 0o700)
    lock = RootLock(root)
    lock.acquire()  # before anything in the root changes: a second scheduler on the root is refused
    try:
        files = ensure_certificates(config.tls_dir, hosts=tuple(dict.fromkeys((host, "127.0.0.1", "localhost")))) \
            if use_tls else None
        config_path = config.save(root / "service.json")
        scheduler_file = root / "scheduler.json"
        scheduler_file.unlink(missing_ok=True)  # a stale one: the lock says no live scheduler owns it
        # the host: `nexus down` on another host of the shared root must not signal a pid of its own
        lock.record(role="scheduler", host=socket.gethostname(), address=f"{host}:{port}")
        args = scheduler_command(config_path, scheduler_file, host, port,
                                 dashboard_address or f"{host}:{DASHBOARD_PORT}", files)
    except BaseException:
        lock.release()
        raise
    return Launch(args, service_env(config), cwd=root, keep_fds=[lock.fileno()]), lock


# ------------------------------------------------------------------------------------------- joiners
def wait_for_service(root: Path, wait_s: float) -> tuple[ServiceConfig, str]:
    """The root's config and scheduler address, once ``nexus scheduler`` has written both."""
    config_path, scheduler_file = root / "service.json", root / "scheduler.json"
    deadline, said = time.time() + wait_s, False
    while True:
        try:
            address = json.loads(scheduler_file.read_text())["address"]
            return ServiceConfig.load(config_path), address
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        if time.time() > deadline:
            raise Unavailable(f"no scheduler in {root} after {wait_s:g} s (no service.json / scheduler.json): "
                              "start `nexus scheduler --root` on it first")
        if not said:
            print(f"waiting for the scheduler of {root} …", file=sys.stderr, flush=True)
            said = True
        time.sleep(0.5)


def _own_host(config: ServiceConfig, scheduler: str, host: str | None, no_tls: bool, what: str) -> str:
    """This process's address, and the TLS rule: a service without TLS is joined off loopback only when
    the operator says so (``--no-tls``)."""
    if host is None:
        target = address_host(scheduler)
        host = target if is_loopback(target) else facing_address(target)
    if no_tls and config.tls:
        raise SpecError(f"--no-tls: the service in {config.root} uses TLS; its {what} must too (drop --no-tls)")
    if not config.tls and not is_loopback(host) and not no_tls:
        raise SpecError(f"the service in {config.root} runs without TLS, and this {what} would listen on {host} "
                        "(not loopback): restart the scheduler with TLS (the default off loopback), or pass "
                        "--no-tls to accept it")
    return host


def plan_worker(root: Path, role: str, host: str | None = None, name: str | None = None, rank: int | None = None,
                scratch: Path | None = None, memory_limit: str | None = None, no_tls: bool = False,
                wait_s: float = 600.0) -> Launch:
    """A worker of ``role``. ``rank`` (actor only) names it ``actor-RANK``: the supervisor gives the actor
    group's ranks to ACTOR workers in name order, so ranks keep their order across restarts."""
    if role not in ROLE_RESOURCES:
        raise SpecError(f"unknown role {role!r}: one of {', '.join(ROLE_RESOURCES)}")
    config, scheduler = wait_for_service(root, wait_s)
    if rank is not None:
        if role != "actor":
            raise SpecError(f"--rank is for actor workers, not {role!r}")
        if not 0 <= rank < config.actor_ranks:
            raise SpecError(f"--rank {rank}: the service's actor group has ranks 0..{config.actor_ranks - 1} "
                            f"(actor_ranks = {config.actor_ranks})")
    host = _own_host(config, scheduler, host, no_tls, f"{role} worker")
    name = name or (f"actor-{rank}" if rank is not None else f"{role}-{socket.gethostname()}-{os.getpid()}")
    env = {**service_env(config), **role_env(role)}
    if scratch is not None:
        scratch = private_mkdir(Path(scratch).resolve())
        env["TMPDIR"] = str(scratch)  # temporary files on this host's disk, not the shared root
    files = tls_files(config.tls_dir) if config.tls else None
    args = worker_command(root / "scheduler.json", name, role, host, memory_limit or config.cluster.memory_limit,
                          files, scratch)
    return Launch(args, env, cwd=scratch)


def plan_gateway(root: Path, host: str | None = None, port: int | None = None, advertise: str | None = None,
                 no_tls: bool = False, wait_s: float = 600.0) -> Launch:
    """The tenant gateway; HTTPS on a non-loopback address of a TLS service (certificate for ``host`` and
    ``advertise``, the name clients use)."""
    config, scheduler = wait_for_service(root, wait_s)
    host = _own_host(config, scheduler, host, no_tls, "gateway")
    cert = None
    if config.tls and not is_loopback(host):
        names = tuple(dict.fromkeys(n for n in (advertise, host, "localhost", "127.0.0.1") if n))
        cert = server_certificate(config.tls_dir, "gateway", names)
    (config.gateway_dir / "gateway.json").unlink(missing_ok=True)  # clients wait for the new one
    args = gateway_command(root / "service.json", host, port, cert, advertise)
    return Launch(args, service_env(config), cwd=root)
