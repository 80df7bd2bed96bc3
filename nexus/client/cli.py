"""``nexus`` command line: ``demo``, ``up`` (a long-running local service), ``status``, ``logs``, ``report``
and ``export`` (a tenant's policy version as a self-contained directory)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path


def _demo(a: argparse.Namespace) -> int:
    from nexus.client.demo import run_demo

    infos = run_demo(a.root, rl_updates=a.rl_updates, sft_steps=a.sft_steps)
    return 0 if all(i["state"] == "done" for i in infos) else 1


def _up(a: argparse.Namespace) -> int:
    from nexus.client.api import Nexus

    nx = Nexus.local(a.root, n_sim=a.sim_workers, dashboard_address=a.dashboard, **_backbone_config(a))
    print(f"JoyNexus service up\n  gateway: {nx.service.gateway_url} (docs: {nx.service.gateway_url}/docs)\n"
          f"  operator token: {nx.service.config.gateway_dir / 'operator.token'}\n"
          f"  scheduler (service-internal): {nx.service.address}\n  dashboard: {nx.dashboard_link}\n"
          "Ctrl-C stops it.", flush=True)
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    from nexus.client.cli_control import keep_up

    try:  # a dead scheduler or a spent restart budget: global restart on the same root
        nx = keep_up(nx, lambda: stop, lambda: Nexus.local(a.root, n_sim=a.sim_workers, dashboard_address=a.dashboard,
                                                        **_backbone_config(a)))
    except KeyboardInterrupt:
        pass
    nx.close()
    return 0


def _connect(a: argparse.Namespace):
    """The service's gateway as its operator: URL and operator token from the root (0600 files), or
    ``--address http://… --token …``."""
    from nexus.client.api import Nexus
    from nexus.gateway.auth import read_gateway_url, read_operator_token

    gateway = Path(a.root) / "gateway"
    address = a.address or read_gateway_url(gateway)
    if not address:
        raise SystemExit(f"no running gateway recorded in {gateway}")
    token = getattr(a, "token", None) or read_operator_token(gateway)
    return Nexus(address, token=token)


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
    from nexus.client.cli_control import roles_table

    console.print(roles_table(st))
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


def _common_connection_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("--root", default="runs/service", help="service root (reads its scheduler.json)")
    q.add_argument("--address", default=None, help="gateway URL instead of --root")


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
        info = nx.tenant(a.tenant).export(a.version, a.out, server_path=a.server_path)
    print(f"exported {info['tenant']} version {info['version']} to {info.get('local_path') or info['path']}"
          + (f" (on the service: {info['path']})" if info.get("local_path") else ""))
    for name in info["files"]:
        print(f"  {name}")
    return 0


def _add_export_parser(sub) -> None:
    e = sub.add_parser("export", help="write a tenant's policy version as a self-contained directory "
                                      "(load it with nexus.policy.load, no service needed)")
    e.add_argument("tenant")
    e.add_argument("--version", type=int, default=None, help="policy version (default: current)")
    e.add_argument("--out", default=None, help="local directory to download it into (must not exist or be "
                                              "empty); default: only written to the tenant's exports/vNNNNNN/")
    e.add_argument("--server-path", default=None, help="write it there on the service instead (tenant tokens: "
                                                      "inside the tenant's output dir only)")
    _common_connection_args(e)
    e.add_argument("--token", default=None, help="with --address: the operator's or the tenant's token")
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
    s.add_argument("--address", default=None, help="gateway URL instead of --root")
    s.add_argument("--token", default=None, help="with --address: the operator's (or a tenant's) token")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_status)
    lg = sub.add_parser("logs", help="a tenant's jobs and their metric history")
    r = sub.add_parser("report", help="PNG plots of a tenant: learning curves and utilization timeline")
    for q in (lg, r):
        q.add_argument("tenant")
        q.add_argument("--root", default="runs/service", help="service root (reads its scheduler.json)")
        q.add_argument("--address", default=None, help="gateway URL instead of --root")
        q.add_argument("--token", default=None, help="with --address: the operator's or the tenant's token")
    lg.set_defaults(fn=_logs)
    r.add_argument("--out", default=".", help="folder for the PNG files")
    r.set_defaults(fn=_report)
    from nexus.client.cli_control import add_commands

    add_commands(sub, _connect, _common_connection_args)
    _add_export_parser(sub)
    a = p.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
