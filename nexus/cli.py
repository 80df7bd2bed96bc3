"""``nexus`` command line: ``demo``, ``up`` (a long-running local service) and ``status``."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path


def _demo(a: argparse.Namespace) -> int:
    from nexus.demo import run_demo

    infos = run_demo(a.root, rl_updates=a.rl_updates, sft_steps=a.sft_steps)
    return 0 if all(i["state"] == "done" for i in infos) else 1


def _up(a: argparse.Namespace) -> int:
    from nexus.api import Nexus

    nx = Nexus.local(a.root, n_sim=a.sim_workers, dashboard_address=a.dashboard)
    print(f"JoyNexus service up\n  scheduler: {nx.service.address}\n  dashboard: {nx.dashboard_link}\n"
          f"  scheduler file: {nx.service.scheduler_file}\nCtrl-C stops it.", flush=True)
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    nx.close()
    return 0


def _status(a: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from nexus.api import Nexus

    address = a.address or json.loads((Path(a.root) / "scheduler.json").read_text())["address"]
    nx = Nexus(address)
    st = nx.status()
    nx.client.close()
    if a.json:
        print(json.dumps(st, indent=2, default=str))
        return 0
    t = Table(title=f"JoyNexus at {address}")
    for col in ("tenant", "kind", "version", "in-flight", "queued", "running", "dropped stale", "training job"):
        t.add_column(col)
    for x in st["tenants"]:
        t.add_row(x["tenant"], x["kind"], str(x["version"]), str(x["inflight"]), str(x["queued"]),
                  str(x["running"]), str(x["dropped_stale"]), x["training_job"] or "-")
    Console().print(t)
    print(f"training queue depth: {st['training_queue']['depth']}; jobs: "
          + ", ".join(f"{j['job']}={j['state']}" for j in st["jobs"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nexus", description="JoyNexus: multi-tenant VLA post-training service")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the four-tenant demo on a local cluster")
    d.add_argument("--root", default="runs/demo")
    d.add_argument("--rl-updates", type=int, default=24)
    d.add_argument("--sft-steps", type=int, default=300)
    d.set_defaults(fn=_demo)
    u = sub.add_parser("up", help="start a long-running local service")
    u.add_argument("--root", default="runs/service")
    u.add_argument("--sim-workers", type=int, default=2)
    u.add_argument("--dashboard", default="127.0.0.1:8787")
    u.set_defaults(fn=_up)
    s = sub.add_parser("status", help="tenants, queues and versions of a running service")
    s.add_argument("--root", default="runs/service", help="service root (reads its scheduler.json)")
    s.add_argument("--address", default=None, help="scheduler address instead of --root")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_status)
    a = p.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
