"""``nexus scheduler``, ``nexus gateway``, ``nexus worker``: one service over several hosts (:mod:`nexus.deploy.hosts`).

Every host points at the same service root on shared storage; each command becomes the process it
starts, so a cluster manager (systemd, Kubernetes, SLURM) supervises the real program.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nexus.config.service import load_service_config
from nexus.deploy import hosts as deploy
from nexus.deploy.processes import ROLE_RESOURCES


def _scheduler(a: argparse.Namespace) -> int:
    config = load_service_config(a.config, a.set, root=a.root, host=a.host)
    launch, _ = deploy.plan_scheduler(config, a.port, a.dashboard, a.tls)
    print(f"JoyNexus scheduler on {config.host}:{a.port} (root {config.root})", flush=True)
    launch.exec()


def _worker(a: argparse.Namespace) -> int:
    launch = deploy.plan_worker(Path(a.root).resolve(), a.role, a.host, a.name, a.rank,
                                Path(a.scratch) if a.scratch else None, a.memory_limit, a.no_tls, a.wait)
    launch.exec()


def _gateway(a: argparse.Namespace) -> int:
    launch = deploy.plan_gateway(Path(a.root).resolve(), a.host, a.port, a.advertise, a.no_tls, a.wait)
    launch.exec()


def _joiner(p: argparse.ArgumentParser, default_root: str, what: str) -> None:
    p.add_argument("--root", default=default_root, help=f"the service root on shared storage (default {default_root})")
    p.add_argument("--host", default=None, help=f"address the {what} listens on (default: this host's address on "
                                                "the route to the scheduler)")
    p.add_argument("--no-tls", action="store_true", help="join a service without TLS from a non-loopback address")
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the scheduler (default 600)")


def add_commands(sub, default_root: str, parents: list[argparse.ArgumentParser] = ()) -> None:
    s = sub.add_parser("scheduler", parents=list(parents),
                       help="run the scheduler with the Nexus plugin on this host (writes the root's service.json)")
    s.add_argument("--root", default=None, help=f"service root on shared storage (default: the config's, else "
                                                f"{default_root})")
    s.add_argument("--config", default=None, help="service TOML file (see configs/service.toml)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    s.add_argument("--host", default=None, help="address to listen on (default: the config's host, 127.0.0.1)")
    s.add_argument("--port", type=int, default=deploy.SCHEDULER_PORT,
                   help=f"scheduler port (default {deploy.SCHEDULER_PORT}; 0: any free port)")
    s.add_argument("--dashboard", default=None, help=f"dashboard host:port (default HOST:{deploy.DASHBOARD_PORT})")
    s.add_argument("--tls", action=argparse.BooleanOptionalAction, default=None,
                   help="Dask over mutual TLS (default: on unless the host is loopback or the config says so)")
    s.set_defaults(fn=_scheduler)

    w = sub.add_parser("worker", parents=list(parents), help="run a worker of one role on this host")
    w.add_argument("--role", required=True, choices=sorted(ROLE_RESOURCES), help="sim, actor, infer or tracker "
                   "(the MLflow tracker's own worker, with the config's cluster.tracker_worker)")
    _joiner(w, default_root, "worker")
    w.add_argument("--name", default=None, help="worker name (default: ROLE-HOSTNAME-PID; actor-RANK with --rank)")
    w.add_argument("--rank", type=int, default=None, help="actor only: this worker's rank in the actor group")
    w.add_argument("--scratch", default=None, help="this host's scratch directory (Dask spill, temporary files)")
    w.add_argument("--memory-limit", default=None, help="Dask's memory limit (default: the config's "
                                                        "cluster.memory_limit)")
    w.set_defaults(fn=_worker)

    g = sub.add_parser("gateway", parents=list(parents), help="run the tenant gateway on this host")
    _joiner(g, default_root, "gateway")
    g.add_argument("--port", type=int, default=None, help="port (default: the config's gateway_port; 0: any free)")
    g.add_argument("--advertise", default=None, help="host name clients use (written into its URL and HTTPS "
                                                     "certificate)")
    g.set_defaults(fn=_gateway)
