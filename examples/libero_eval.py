"""LIBERO's standard evaluation of a policy through the service: every task of a suite, one episode from each of
its fixed initial states (50 by default), the suite's step limit (spatial 220, object 280, goal 300, 10 520,
90 400) after 10 settle steps, and the papers' table — success per task and on average.

    python examples/libero_eval.py --suite spatial --policy EXPORTED_DIR        # the whole protocol (500 episodes)
    python examples/libero_eval.py --suite goal --tasks 0 1 --initial-states 2  # a bounded run
    python examples/libero_eval.py --url http://127.0.0.1:PORT --token TOKEN ... # on a running service

``--policy``: an exported policy directory (``tenant.export(...)``) the tenant starts from; without it the
tenant's fresh head acts (success ~0: a smoke run of the protocol). The report is printed and written as JSON.
On a 2-core CPU one LIBERO step with two 64 px cameras takes ~0.3 s, so the whole protocol of one suite is
hours; on a GPU host, many simulator workers (``--n-sim``) share it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nexus.client.api import Nexus
from nexus.spec import TenantSpec

SUITES = ("spatial", "object", "goal", "10", "90")


def evaluate(nx: Nexus, suite: str, tasks: list[int] | None = None, initial_states: int = 50,
             policy: str | None = None, tenant: str = "libero-eval", timeout: float = 86_400) -> dict:
    t = nx.create_tenant(TenantSpec(name=tenant, env=f"libero/{suite}", action_dim=7, init_from=policy))
    return t.evaluate(protocol="suite", tasks=tasks, initial_states=initial_states).result(timeout=timeout)


def table(report: dict) -> str:
    lines = [f"{'task':>4}  {'success':>7}  {'episodes':>8}  instruction"]
    lines += [f"{r['task']:>4}  {r['success_rate']:>7.1%}  {r['episodes']:>8}  {r['instruction']}"
              for r in report["tasks"]]
    lines.append(f"{'avg':>4}  {report['average_success_rate']:>7.1%}  {report['episodes']:>8}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=SUITES, default="spatial")
    ap.add_argument("--tasks", type=int, nargs="*", help="task indices (default: all of the suite)")
    ap.add_argument("--initial-states", type=int, default=50, help="episodes per task, initial states 0..n-1")
    ap.add_argument("--policy", help="an exported policy directory to evaluate")
    ap.add_argument("--url", help="a running service's gateway (default: start a local one)")
    ap.add_argument("--token", help="the gateway token (with --url)")
    ap.add_argument("--root", default="runs/libero-eval", help="the local service's root")
    ap.add_argument("--n-sim", type=int, default=2, help="simulator workers of the local service")
    ap.add_argument("--out", default="libero_eval.json")
    args = ap.parse_args()
    kw = {"tasks": args.tasks or None, "initial_states": args.initial_states,
          "policy": str(Path(args.policy).resolve()) if args.policy else None}
    if args.url:
        report = evaluate(Nexus(args.url, token=args.token), args.suite, **kw)
    else:
        with Nexus.local(args.root, n_sim=args.n_sim) as nx:
            report = evaluate(nx, args.suite, **kw)
    print(table(report))
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"report: {args.out}")


if __name__ == "__main__":
    main()
