"""Where the time scale k leaks into the emulated figures: one RL job alone on a 1-1-2 emulated service at each k,
its producers' round trips split into the engine's queueing, its compute and the host's messaging, all in
emulated seconds (real seconds x k). A figure that holds across k has the same emulated seconds at every k;
what grows with k is the host's own time (Dask messages, timer lateness), which does not shrink with k.

    python experiments/paper_scale/k_overhead.py --ks 5,20 --tenant ms-push      # ~3 min
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench import CAL, paper_workload  # noqa: E402
from emulated import EmulatedService, Workload, policy  # noqa: E402

SPLIT = ("sim_s", "engine_wait_s", "compute_s", "messaging_s", "rtt_s")


def one_k(workload: Workload, k: float) -> dict[str, Any]:
    svc = EmulatedService(workload, "1-1-2", CAL, k, "isolated")
    try:
        run = svc.run(policy("isolated"))
        results = {j["tenant"]: j["result"] for j in svc.nx.status(limit=1000)["jobs"] if j.get("result")}
    finally:
        svc.close()
    rollouts = [s for s in run["spans"] if s["service"] == "simulator"]
    row: dict[str, Any] = {"k": k, "load": os.getloadavg()[0], "makespan_s": run["makespan_s"] * k,
                           "busy_s": {s: b * k for s, b in run["busy_s"].items()},
                           "rollout_span_s": k * sum(s["t1"] - s["t0"] for s in rollouts) / max(len(rollouts), 1)}
    for name, res in results.items():
        row[name] = {x: res.get(x, 0.0) * k for x in SPLIT} | {"requests": res.get("requests", 0)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", default="5,20")
    ap.add_argument("--tenant", default="ms-push", help="one of the paper workload's RL tenants")
    ap.add_argument("--out", default=str(HERE / "k_overhead.json"))
    args = ap.parse_args()
    wl = paper_workload()
    wl = Workload("k-overhead", [j for j in wl.jobs if j.tenant == args.tenant], wl.datapath)
    rows = [one_k(wl, float(k)) for k in args.ks.split(",")]
    print(f"{args.tenant} alone on 1-1-2, emulated seconds (real x k):")
    print(f"{'k':>4} {'load':>5} {'makespan':>9} {'rollout':>8} " + " ".join(f"{x:>14}" for x in SPLIT))
    for r in rows:
        t = r[args.tenant]
        print(f"{r['k']:>4g} {r['load']:>5.1f} {r['makespan_s']:>9.1f} {r['rollout_span_s']:>8.2f} "
              + " ".join(f"{t[x]:>14.1f}" for x in SPLIT))
    Path(args.out).write_text(json.dumps({"tenant": args.tenant, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
