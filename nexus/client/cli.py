"""``nexus`` command line.

Service: ``up`` (a long-running local service, from ``--config service.toml`` and ``--set`` overrides),
``down``, ``status`` (with the roles' health), ``scale-inference``; over several hosts: ``scheduler``,
``gateway``, ``worker --role sim|actor|infer`` (one root on shared storage, :mod:`nexus.deploy.hosts`). Work:
``submit`` (tenant and job TOML files), ``list`` (jobs and their progress), ``cancel``, ``delete``, ``logs``
(a tenant's metric history, from the service and the tenant's manifest), ``report`` (PNG plots), ``export``
(a tenant's policy version as a self-contained directory). ``demo`` runs the four-tenant demo.

Commands reach a running service through its tenant gateway as the operator: the gateway's URL and the
operator token are read from ``<root>/gateway/`` (0600 files), or given as ``--address http://… --token …``.

Every failure is one line on stderr and a non-zero exit status (1: refused or failed, 2: usage,
3: no service reachable, 130: interrupted); ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nexus.client.api import JobProgress, Nexus
from nexus.client.cli_control import add_commands, keep_up, roles_table
from nexus.client.cli_deploy import add_commands as add_deploy_commands
from nexus.client.demo import run_demo
from nexus.client.report import format_log, manifest_log, merge_logs, write_report
from nexus.config.service import ServiceConfig, load_service_config, load_submission
from nexus.config.validation import validate_job, validate_tenant
from nexus.deploy.local import lock_holder
from nexus.errors import NexusError, NotFound, Unavailable
from nexus.gateway.auth import read_gateway_url, read_operator_token

DEFAULT_ROOT = "runs/service"
EXIT_ERROR, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_INTERRUPTED = 1, 2, 3, 130


# ------------------------------------------------------------------------------------------- connect
def _gateway_address(a: argparse.Namespace) -> tuple[str, str | None, str]:
    """The gateway URL, the token to use and where they came from (for the error hint)."""

    token = getattr(a, "token", None)
    if a.address:
        return a.address, token, f"--address {a.address}"
    gateway = Path(a.root) / "gateway"
    url = read_gateway_url(gateway)
    if not url or lock_free(a.root):
        raise Unavailable(f"no service: no running gateway recorded in {gateway} — is `nexus up` running? "
                          f"(looked in {Path(a.root)}; pass --root or --address)")
    if token is None:
        try:
            token = read_operator_token(gateway)
        except OSError as e:
            raise Unavailable(f"cannot read the operator token in {gateway}: {e.strerror or e}") from None
    return url, token, str(gateway)


def lock_free(root: str | Path) -> bool:
    """No live service holds ``root`` (its gateway file, if any, is stale)."""

    return (Path(root) / "service.lock").exists() and lock_holder(root) is None


def _connect(a: argparse.Namespace):
    """The service's gateway as its operator (the CLI speaks the HTTP API only; a ``tcp://`` --address is
    refused with a hint to give the gateway URL)."""

    address, token, source = _gateway_address(a)
    ca = a.ca or (Path(a.root) / "tls" / "ca.pem" if address.startswith("https://") else None)
    try:
        nx = Nexus(address, token=token, timeout=a.timeout, ca=ca)
    except Unavailable as e:
        raise Unavailable(f"{e} — is `nexus up` running? (looked in {source})") from None
    try:
        nx.transport.probe(a.timeout)  # reachable and the token accepted, within --timeout
        return nx
    except BaseException as e:
        nx.close()
        if not isinstance(e, Unavailable):
            raise
        raise Unavailable(f"{e} — is `nexus up` running? (looked in {source})") from None


def _console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)


def _fmt(x: Any, nd: int = 4) -> str:
    if isinstance(x, float):
        return f"{x:.{nd}g}"
    return "-" if x is None else str(x)


# ------------------------------------------------------------------------------------------- service
def _up(a: argparse.Namespace, start: Callable[[ServiceConfig], Nexus] | None = None) -> int:
    """``start``: how the local service starts from its settings (default: ``Nexus.local``; a tool that models the
    devices passes its own)."""
    cluster = {k: v for k, v in (("sim_workers", a.sim_workers), ("dashboard_address", a.dashboard)) if v}
    cfg = _with_backbone(load_service_config(a.config, a.set, root=a.root, cluster=cluster or None), a)
    if cfg.cluster.dashboard_address is None:
        cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(
            update={"dashboard_address": f"{cfg.host}:8787"})})
    print(f"starting JoyNexus in {cfg.root} …", flush=True)
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)  # `nexus down`
    start = start or (lambda c: Nexus.local(config=c))
    nx = start(cfg)
    try:
        link = nx.service.dashboard_link
        uri = cfg.resolved_tracking_uri()
        gw = nx.service.gateway_url
        print(f"JoyNexus service up\n"
              f"  root:        {cfg.root}\n"
              f"  gateway:     {gw} (docs: {gw}/docs)\n"
              f"  operator token: {cfg.gateway_dir / 'operator.token'}\n"
              f"  scheduler (service-internal): {nx.service.address}\n"
              f"  dashboard:   {link}\n"
              f"  Nexus page:  {link.replace('/status', '/nexus')}\n"
              f"  MLflow:      {uri}  (experiment {cfg.resolved_experiment()!r}; "
              f"`mlflow ui --backend-store-uri {uri}`)\n"
              f"Stop with Ctrl-C or `nexus down --root {cfg.root}`.", flush=True)

        # a dead scheduler or a spent restart budget: global restart on the same root
        nx = keep_up(nx, lambda: stop, lambda: start(cfg))
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping …", flush=True)
        nx.close()
    print("stopped")
    return 0


def _add_backbone_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("backbone (shortcuts for --set backbone.<field>=...)")
    g.add_argument("--backbone-path", default=None,
                   help="a Hugging Face checkpoint directory of the backbone (from_pretrained, never a hub download)")
    g.add_argument("--backbone-family", default=None, choices=["qwen3vl", "paligemma"])
    g.add_argument("--backbone-size", default=None, help="offline preset without a checkpoint (tiny, small, "
                   "medium; the real shapes qwen3vl 2b / 4b, paligemma 3b: random weights)")
    g.add_argument("--image-size", type=int, default=None)


def _with_backbone(cfg, a: argparse.Namespace):
    """The config with the backbone options applied (validated like the file: a bad path is refused)."""

    chosen = {"local_path": a.backbone_path, "family": a.backbone_family, "size": a.backbone_size,
              "image_size": a.image_size}
    chosen = {k: v for k, v in chosen.items() if v is not None}
    if not chosen:
        return cfg
    return ServiceConfig.model_validate({**cfg.model_dump(), "backbone": {**cfg.backbone.model_dump(), **chosen}})


def _export(a: argparse.Namespace) -> int:
    with _connect(a) as nx:
        info = nx.tenant(a.tenant).export(a.version, a.out, server_path=a.server_path)
    print(f"exported {info['tenant']} version {info['version']} to {info.get('local_path') or info['path']}"
          + (f" (on the service: {info['path']})" if info.get("local_path") else ""))
    for name in info["files"]:
        print(f"  {name}")
    return 0


def _down(a: argparse.Namespace) -> int:

    root = Path(a.root).resolve()
    holder = lock_holder(root)
    if holder is None:
        raise NotFound(f"no running service holds {root} (nothing to stop)")
    pid = int(holder.get("pid", 0))
    if holder.get("host", socket.gethostname()) != socket.gethostname():  # `nexus scheduler` on shared storage
        raise Unavailable(f"the service on {root} runs on host {holder['host']} (pid {pid}): stop it there")
    if pid <= 0:
        raise Unavailable(f"the service on {root} did not record its process id; stop it with Ctrl-C")
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + a.wait
    while lock_holder(root) is not None:
        if time.time() > deadline:
            raise Unavailable(f"the service on {root} (pid {pid}) is still stopping after {a.wait:g} s")
        time.sleep(0.2)
    print(f"stopped the service on {root} (pid {pid})")
    return 0


def add_page_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--limit", type=int, default=None, help=f"{what} per page (default 100, at most 1000)")
    p.add_argument("--cursor", default=None, help="continue after a page (the cursor it printed)")


def _more(page: dict[str, Any] | None, shown: int, total_key: str, what: str) -> str | None:
    """The hint under a page that is not the last: how many there are and the cursor of the next page."""
    if not page or page.get("next_cursor") is None:
        return None
    return f"{shown} of {page.get(total_key, '?')} {what} shown; next page: --cursor {page['next_cursor']}"


def _status(a: argparse.Namespace) -> int:
    from rich.table import Table

    with _connect(a) as nx:
        st = nx.status(a.limit, a.cursor)
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

    console.print(roles_table(st))
    hint = _more(st.get("page"), len(st["tenants"]), "tenants_total", "tenants")
    if hint:
        console.print(hint)
    return 0


# ------------------------------------------------------------------------------------------- work
def jobs_table(progress: list, title: str = "jobs"):
    from rich.table import Table

    t = Table(title=title)
    for col in ("job", "tenant", "kind", "state", "progress", "version", "metrics", "elapsed s"):
        t.add_column(col)
    for p in progress:
        t.add_row(p.job, p.tenant, p.kind, p.state + (f" ({p.error})" if p.error else ""),
                  f"{p.done}/{p.total} {p.unit}", _fmt(p.version),
                  "  ".join(f"{k} {v:.3g}" for k, v in p.metrics.items()) or "-", f"{p.elapsed_s:.0f}")
    return t


def _list(a: argparse.Namespace) -> int:

    with _connect(a) as nx:
        if a.all:
            pages = list(nx.pages(a.limit, a.tenant))
            jobs, page = [j for pg in pages for j in pg["jobs"]], None
        else:
            st = nx.status(a.limit, a.cursor, a.tenant)
            jobs, page = st["jobs"], st.get("page")
    if a.json:
        print(json.dumps(jobs, indent=2, default=str))
        return 0
    if not jobs:
        print("no jobs" + (f" of tenant {a.tenant!r}" if a.tenant else ""))
        return 0
    _console().print(jobs_table([JobProgress.from_info(j) for j in jobs]))
    hint = _more(page, len(jobs), "jobs_total", "jobs")
    if hint:
        print(hint)
    return 0


def follow_jobs(jobs: list, console: Any = None, poll_s: float = 1.0) -> list:
    """Progress bars for several jobs at once, until all have ended; returns their last progress."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[metric]}"), TimeElapsedColumn(), console=console) as bar:
        first = [j.progress() for j in jobs]
        tasks = [bar.add_task(f"{p.job} ({p.unit})", total=p.total, metric="") for p in first]
        last = first
        while True:
            last = [j.progress() for j in jobs]
            for task, p in zip(tasks, last, strict=True):
                metric = "  ".join(f"{k} {v:.3f}" for k, v in p.metrics.items())
                metric += f"  {p.state}" if p.finished else ""
                bar.update(task, completed=p.done, metric=metric)
            if all(p.finished for p in last):
                return last
            time.sleep(poll_s)


def _submit(a: argparse.Namespace) -> int:

    sub = load_submission(a.files, a.set, a.tenant)
    if sub.tenant is not None:  # refuse a bad spec before connecting, with the service's own checks and words
        spec, _ = validate_tenant(sub.tenant)
        for job in sub.jobs:
            validate_job(spec, job)
    with _connect(a) as nx:
        jobs = nx.submit(*a.files, overrides=a.set, tenant=a.tenant)
        for j in jobs:
            p = j.progress()
            print(f"submitted {j.id} ({p.kind}, tenant {p.tenant})")
        if not jobs:
            print("tenant ready; no jobs in these files")
        if a.follow and jobs:
            last = follow_jobs(jobs, _console())
            failed = [p for p in last if p.state != "done"]
            for p in failed:
                print(f"job {p.job} {p.state}: {p.error}", file=sys.stderr)
            return EXIT_ERROR if failed else 0
    return 0


def _tenant_log(a: argparse.Namespace) -> dict[str, Any]:
    """A tenant's jobs: the running service's (live, with histories) merged with the tenant manifest's job
    records (every service that ever ran it). Works without a service from the manifest alone."""

    live, why = None, None
    try:
        with _connect(a) as nx:
            live = nx.tenant_log(a.tenant)
    except Unavailable as e:
        why = str(e)
    except NexusError as e:  # the service does not know the tenant: its manifest may
        why = str(e)
    output_dir = Path(live["tenant"]["output_dir"]) if live else Path(a.root) / "tenants" / a.tenant
    stored = manifest_log(output_dir)
    if live is None and stored is None:
        raise NotFound(f"unknown tenant {a.tenant!r}: {why}; and no manifest at {output_dir / 'manifest.json'}")
    if live is None:
        print(f"(service not reachable, showing the manifest in {output_dir})", file=sys.stderr)
    return merge_logs(live, stored)


def _logs(a: argparse.Namespace) -> int:

    log = _tenant_log(a)
    for line in format_log(log, kinds=a.kind, last=a.last):
        print(line)
    return 0


def _report(a: argparse.Namespace) -> int:

    log = _tenant_log(a)
    for path in write_report(log, Path(a.out)):
        print(path)
    return 0


def _demo(a: argparse.Namespace) -> int:

    infos = run_demo(a.root, sft_steps=a.sft_steps, rl_updates=a.rl_updates, eval_episodes=a.eval_episodes)
    return 0 if all(i["state"] == "done" for i in infos) else EXIT_ERROR


# ------------------------------------------------------------------------------------------- parser
def add_connection_args(p: argparse.ArgumentParser) -> None:
    """``--root`` / ``--address`` / ``--token`` / ``--timeout``: how a command finds a running service."""
    p.add_argument("--root", default=DEFAULT_ROOT,
                   help=f"service root (reads its gateway URL and operator token; default {DEFAULT_ROOT})")
    p.add_argument("--address", default=None, help="gateway URL (http[s]://host:port) instead of --root")
    p.add_argument("--token", default=None, help="with --address: the operator's (or a tenant's) token")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the service (default 10)")
    p.add_argument("--ca", default=None, help="CA certificate of an https:// gateway (default: <root>/tls/ca.pem)")


def add_up_options(u: argparse.ArgumentParser) -> None:
    """``nexus up``'s options (a tool that starts the service its own way takes them too)."""
    u.add_argument("--config", default=None, help="service TOML file (see configs/service.toml)")
    u.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting, e.g. --set backbone.family=paligemma --set infer_max_batch=16")
    u.add_argument("--root", default=None, help=f"service root (default: the config's, else {DEFAULT_ROOT})")
    u.add_argument("--sim-workers", type=int, default=None)
    u.add_argument("--dashboard", default=None, help="dashboard host:port (default 127.0.0.1:8787)")
    _add_backbone_options(u)


def build_parser() -> argparse.ArgumentParser:
    # --debug before or after the command (the subcommands' copy must not reset the top-level one)
    p = argparse.ArgumentParser(prog="nexus", description="JoyNexus: multi-tenant VLA post-training service")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser(
        "demo", parents=[common], help="run the four-tenant demo on a local cluster (~10 min on 2 cores)"
    )
    d.add_argument("--root", default="runs/demo")
    d.add_argument("--sft-steps", type=int, default=None, help="SFT steps of pick-sft (default: the demo's budget)")
    d.add_argument("--rl-updates", type=int, default=None, help="PPO updates of push-rl")
    d.add_argument("--eval-episodes", type=int, default=None)
    d.set_defaults(fn=_demo)

    u = sub.add_parser("up", parents=[common],
                       help="start a long-running local service (Ctrl-C or `nexus down` stops it)")
    add_up_options(u)
    u.set_defaults(fn=_up)

    dn = sub.add_parser("down", parents=[common], help="stop the service running on a root")
    dn.add_argument("--root", default=DEFAULT_ROOT)
    dn.add_argument("--wait", type=float, default=60.0, help="seconds to wait for it to stop")
    dn.set_defaults(fn=_down)

    s = sub.add_parser("status", parents=[common], help="tenants, queues, versions and workers")
    add_connection_args(s)
    s.add_argument("--json", action="store_true")
    add_page_args(s, "tenants")
    s.set_defaults(fn=_status)

    ls = sub.add_parser("list", parents=[common], help="jobs with their state and progress, newest first")
    add_connection_args(ls)
    ls.add_argument("--tenant", default=None, help="only this tenant's jobs")
    ls.add_argument("--json", action="store_true")
    add_page_args(ls, "jobs")
    ls.add_argument("--all", action="store_true", help="every page, not only the first")
    ls.set_defaults(fn=_list)

    sb = sub.add_parser("submit", parents=[common], help="create a tenant and submit jobs from TOML files")
    sb.add_argument("files", nargs="+", help="tenant and job files (see configs/)")
    sb.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field: tenant.<field>=... or job.<field>=... (every job)")
    sb.add_argument("--tenant", default=None, help="submit the jobs to this existing tenant")
    sb.add_argument("--follow", action="store_true", help="show progress bars until the jobs end")
    add_connection_args(sb)
    sb.set_defaults(fn=_submit)

    lg = sub.add_parser("logs", parents=[common], help="a tenant's jobs and their metric history, by kind")
    r = sub.add_parser("report", parents=[common], help="PNG plots of a tenant: learning curves, utilization")
    for q in (lg, r):
        q.add_argument("tenant")
        add_connection_args(q)
    lg.add_argument("--kind", action="append", choices=("train", "rollout", "eval", "queue"), default=None,
                    help="only these kinds of rows (repeatable)")
    lg.add_argument("--last", type=int, default=None, help="only the last N rows of each kind per job")
    lg.set_defaults(fn=_logs)
    r.add_argument("--out", default=".", help="folder for the PNG files")
    r.set_defaults(fn=_report)

    e = sub.add_parser("export", parents=[common], help="write a tenant's policy version as a self-contained "
                                                        "directory (load it with nexus.export.policy.load, no service)")
    e.add_argument("tenant")
    e.add_argument("--version", type=int, default=None, help="policy version (default: current)")
    e.add_argument("--out", default=None, help="local directory to download it into (must not exist or be "
                                              "empty); default: only written to the tenant's exports/vNNNNNN/")
    e.add_argument("--server-path", default=None, help="write it there on the service instead (tenant tokens: "
                                                      "inside the tenant's output dir only)")
    add_connection_args(e)
    e.set_defaults(fn=_export)

    add_commands(sub, _connect, add_connection_args, [common])
    add_deploy_commands(sub, DEFAULT_ROOT, [common])
    return p


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, NexusError) else f"{type(e).__name__}: {text}"


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """``parser``: another command line run the same way (a tool's own, with ``fn`` per command)."""
    a = (parser or build_parser()).parse_args(argv)  # usage errors: argparse's message, exit status 2
    try:
        return a.fn(a)
    except KeyboardInterrupt:
        if a.debug:
            raise
        print(f"nexus {a.cmd}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (`nexus logs | head`): stop quietly, and keep Python's exit-time flush quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        if a.debug:
            raise
        print(f"nexus {a.cmd}: error: {_one_line(e)}"
              + ("" if isinstance(e, NexusError) else "  (--debug shows the traceback)"), file=sys.stderr)
        return EXIT_UNAVAILABLE if isinstance(e, Unavailable) else EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
