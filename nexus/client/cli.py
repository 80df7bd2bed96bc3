"""``nexus`` command line: ``demo``, ``up`` (a long-running local service), ``status``, ``logs``, ``report``
and ``export`` (a tenant's policy version as a self-contained directory)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path


def _demo(a: argparse.Namespace) -> int:
    from nexus.client.demo import run_demo

    infos = run_demo(a.root, rl_updates=a.rl_updates, sft_steps=a.sft_steps)
    return 0 if all(i["state"] == "done" for i in infos) else 1


def _up(a: argparse.Namespace) -> int:
    from nexus.client.api import Nexus

    nx = Nexus.local(a.root, n_sim=a.sim_workers, dashboard_address=a.dashboard, **_backbone_config(a))
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


def _connect(a: argparse.Namespace):
    from nexus.client.api import Nexus

    address = a.address or json.loads((Path(a.root) / "scheduler.json").read_text())["address"]
    return Nexus(address)


def _console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)


def _status(a: argparse.Namespace) -> int:
    from rich.table import Table

    with _connect(a) as nx:
        st = nx.status()
    if a.json:
        print(json.dumps(st, indent=2, default=str))
        return 0
    t = Table(title="JoyNexus tenants")
    for col in ("tenant", "kind", "state", "version", "in-flight", "queued", "dropped stale", "training job",
                "actor s", "inference s", "simulator s"):
        t.add_column(col)
    for x in st["tenants"]:
        m = x["metered_s"]
        t.add_row(x["tenant"], x["kind"], x["state"], str(x["version"]), str(x["inflight"]), str(x["queued"]),
                  str(x["dropped_stale"]), x["training_job"] or "-", f"{m['actor']:.2f}", f"{m['inference']:.2f}",
                  f"{m['simulator']:.2f}")
    console = _console()
    console.print(t)
    console.print(f"training queue depth {st['training_queue']['depth']}, inference queue pending "
                  f"{st['inference_queue']['pending']}; busy s: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in sorted(st["busy_s"].items())))
    w = Table(title="workers")
    for col in ("name", "status", "resources", "tasks", "since heartbeat s"):
        w.add_column(col)
    for x in st["workers"]:
        w.add_row(x["name"], x["status"], ",".join(f"{k}={v:g}" for k, v in x["resources"].items()),
                  str(x["processing"]), f"{x['since_heartbeat_s']:.1f}")
    console.print(w)
    return 0


def _logs(a: argparse.Namespace) -> int:
    with _connect(a) as nx:
        log = nx.call("nexus_tenant_log", tenant=a.tenant)
    for job in log["jobs"]:
        print(f"== {job['job']} ({job['kind']}) {job['state']}"
              + (f": {job['error']}" if job["error"] else "") + f"  metered s {job['metered_s']}")
        for h in job["history"]:
            fields = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in h.items())
            print(f"  {fields}")
    return 0


def _report(a: argparse.Namespace) -> int:
    from nexus.client.report import write_report

    with _connect(a) as nx:
        log = nx.call("nexus_tenant_log", tenant=a.tenant)
    for path in write_report(log, Path(a.out)):
        print(path)
    return 0


def _add_backbone_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("backbone")
    g.add_argument("--backbone-path", default=None,
                   help="a Hugging Face checkpoint directory of the backbone (from_pretrained, never a hub download)")
    g.add_argument("--backbone-family", default=None, choices=["qwen3vl", "paligemma"])
    g.add_argument("--backbone-size", default=None, help="offline preset without a checkpoint (tiny, small, medium)")
    g.add_argument("--image-size", type=int, default=None)


def _backbone_config(a: argparse.Namespace) -> dict:
    """ServiceConfig overrides from the backbone options (validated there: a bad path is refused)."""
    chosen = {"local_path": a.backbone_path, "family": a.backbone_family, "size": a.backbone_size,
              "image_size": a.image_size}
    chosen = {k: v for k, v in chosen.items() if v is not None}
    return {"backbone": chosen} if chosen else {}


def _export(a: argparse.Namespace) -> int:
    with _connect(a) as nx:
        info = nx.tenant(a.tenant).export(a.version, a.out)
    print(f"exported {info['tenant']} version {info['version']} to {info['path']}")
    for name in info["files"]:
        print(f"  {name}")
    return 0


def _add_export_parser(sub) -> None:
    e = sub.add_parser("export", help="write a tenant's policy version as a self-contained directory "
                                      "(load it with nexus.policy.load, no service needed)")
    e.add_argument("tenant")
    e.add_argument("--version", type=int, default=None, help="policy version (default: current)")
    e.add_argument("--out", required=True, help="target directory (must not exist or be empty)")
    e.add_argument("--root", default="runs/service", help="service root (reads its scheduler.json)")
    e.add_argument("--address", default=None)
    e.set_defaults(fn=_export)


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
    _add_backbone_options(u)
    u.set_defaults(fn=_up)
    s = sub.add_parser("status", help="tenants, queues and versions of a running service")
    s.add_argument("--root", default="runs/service", help="service root (reads its scheduler.json)")
    s.add_argument("--address", default=None, help="scheduler address instead of --root")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_status)
    lg = sub.add_parser("logs", help="a tenant's jobs and their metric history")
    r = sub.add_parser("report", help="PNG plots of a tenant: learning curves and utilization timeline")
    for q in (lg, r):
        q.add_argument("tenant")
        q.add_argument("--root", default="runs/service", help="service root (reads its scheduler.json)")
        q.add_argument("--address", default=None)
    lg.set_defaults(fn=_logs)
    r.add_argument("--out", default=".", help="folder for the PNG files")
    r.set_defaults(fn=_report)
    _add_export_parser(sub)
    a = p.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
