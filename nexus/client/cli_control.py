"""``nexus`` subcommands of the control plane: ``cancel``, ``delete``, ``scale-inference``; and the roles
table that ``nexus status`` prints."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

STATE_STYLE = {"healthy": "green", "starting": "cyan", "suspect": "yellow", "restarting": "magenta", "failed": "red"}


def roles_table(status: dict[str, Any]):
    """Every role's health: state, worker, restarts (and budget left), heartbeat age, reason."""
    from rich.table import Table

    svc = status.get("service", {})
    t = Table(title=f"roles (service {svc.get('state', '?')})")
    for col in ("role", "kind", "state", "worker", "restarts", "budget left", "since heartbeat s", "reason"):
        t.add_column(col)
    for r in status.get("roles", []):
        age = r["since_heartbeat_s"]
        t.add_row(r["role"], r["kind"], f"[{STATE_STYLE.get(r['state'], 'white')}]{r['state']}[/]", r["worker"] or "-",
                  str(r["restarts"]), str(r["restart_budget_left"]), "-" if age is None else f"{age:.1f}",
                  (r["reason"] or "")[:60])
    return t


def keep_up(nx, should_stop: Callable[[], bool], restart: Callable[[], Any], check_s: float = 5.0):
    """Keep a local service up until ``should_stop()``: when its scheduler process died, or a role's
    restart budget is spent (status ``needs-global-restart``), stop what is left and start a new
    service on the same root (it rediscovers the tenants). Returns the service running at the end."""
    import time

    last = time.time()
    while not should_stop():
        time.sleep(0.5)
        if time.time() - last < check_s:
            continue
        last = time.time()
        reason = None
        if nx.service is not None and nx.service.procs and nx.service.procs[0].poll() is not None:
            reason = "the scheduler process died"
        else:
            try:
                state = nx.status()["service"]["state"]
                if state == "needs-global-restart":
                    reason = "a role's restart budget is spent"
            except Exception as e:  # noqa: BLE001 (a busy scheduler: check again later)
                print(f"status check failed: {e}", flush=True)
        if reason:
            print(f"global restart: {reason}", flush=True)
            try:
                nx.service.close_client(timeout=5)
            finally:
                nx.service.stop()
            nx = restart()
            print(f"JoyNexus service up again\n  scheduler: {nx.service.address}", flush=True)
    return nx


def _cancel(a: argparse.Namespace, connect: Callable) -> int:
    with connect(a) as nx:
        info = nx.job(a.job).cancel()
    print(json.dumps({k: info[k] for k in ("job", "tenant", "state", "error")}) if a.json else
          f"{info['job']}: {info['state']}" + (f" ({info['error']})" if info.get("error") else ""))
    return 0 if info["state"] in ("cancelled", "done", "failed") else 1


def _delete(a: argparse.Namespace, connect: Callable) -> int:
    with connect(a) as nx:
        out = nx.delete_tenant(a.tenant, keep_output=not a.purge)
    if a.json:
        print(json.dumps(out))
    else:
        kept = "deleted" if out["purged"] else "kept"
        print(f"tenant {out['tenant']} deleted; output dir {out['output_dir']} {kept}"
              + (f"; cancelled {', '.join(out['cancelled_jobs'])}" if out["cancelled_jobs"] else ""))
    return 0


def _scale(a: argparse.Namespace, connect: Callable) -> int:
    with connect(a) as nx:
        view = nx.scale_inference(a.n)
    if a.json:
        print(json.dumps(view, default=str))
    else:
        for e in view["engines"]:
            print(f"{e['engine']:<14} {e['state']:<9} {e['worker']:<10} tenants: {', '.join(e['tenants']) or '-'}")
    return 0


def add_commands(sub, connect: Callable, common: Callable[[argparse.ArgumentParser], None],
                 parents: list[argparse.ArgumentParser] = ()) -> None:
    """Register the subcommands; ``connect(args)`` opens a ``Nexus``, ``common`` adds --root/--address,
    ``parents``: shared options (``--debug``)."""
    c = sub.add_parser("cancel", parents=list(parents),
                       help="cancel a job (frees its admission slots, queued items and pins)")
    c.add_argument("job")
    d = sub.add_parser("delete", parents=list(parents),
                       help="delete a tenant (cancels its jobs; keeps its output dir unless --purge)")
    d.add_argument("tenant")
    d.add_argument("--purge", action="store_true", help="also delete the tenant's output dir")
    s = sub.add_parser("scale-inference", parents=list(parents), help="grow or shrink the inference pool to N engines")
    s.add_argument("n", type=int)
    for p, fn in ((c, _cancel), (d, _delete), (s, _scale)):
        common(p)
        p.add_argument("--json", action="store_true")
        p.set_defaults(fn=lambda a, fn=fn: fn(a, connect))
