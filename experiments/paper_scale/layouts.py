"""The same 8 devices, split otherwise: is the paper's 2-2-4 the limit, or its layout?

``levers.py`` shows elastic on 2-2-4 within ~10 % of the ceiling of fixed roles (the simulators' stepping on
4 devices). A layout moves that ceiling: this script plans every split a-i-s of N devices from the isolated
run's measured demand — the actor's update time on one device (a group of a devices is ``a * dp ** log2 a``
times faster, the calibration's ``dp_efficiency``), inference's busy time, the simulators' stepping — each
split's bound being its busiest service's work over its devices. It then runs the paper's workload on 2-2-4
and on the best-planned splits, under ``elastic`` and ``elastic`` with the ``critical`` training-queue order
(RL items first, the job with the most work left first: with one actor device, the order of updates is what
the makespan waits on), each against the same isolated 1-1-2 run (two rounds each, the slower kept, k = 3);
then both policies on the best split again at each k of ``--ks``, against a fresh isolated run at that k.

    python experiments/paper_scale/layouts.py           # ~14 min on 2 cores -> layouts.json
    python experiments/paper_scale/layouts.py --alone   # then each job alone on its best split (~3 min)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402
from emulated import policy  # noqa: E402

from nexus.emulator.settings import load_calibration  # noqa: E402

PAPER_LAYOUT = "2-2-4"


def plan(total: int, iso: dict[str, Any], dp_efficiency: float) -> list[dict[str, Any]]:
    """Every split of ``total`` devices (at least one per service), best bound first: each service's work from
    the isolated 1-1-2 run (one actor device, one inference device; the simulators' stepping) over its
    devices; the split's makespan bound is the largest, its efficiency ceiling the isolated device time over
    ``total`` devices for that long."""
    actor, infer = iso["busy_s"]["actor"], iso["busy_s"]["inference"]
    stepping = iso["simulator_split_s"]["stepping"]
    rows = []
    for a in range(1, total - 1):
        for i in range(1, total - a):
            s = total - a - i
            speedup = a * dp_efficiency ** math.log2(a)
            bounds = {"actor": actor / speedup, "inference": infer / i, "simulator": stepping / s}
            by = max(bounds, key=bounds.__getitem__)
            rows.append({"layout": f"{a}-{i}-{s}", "bounds_s": bounds, "bound_by": by, "bound_s": bounds[by],
                         "efficiency_ceiling": iso["device_s"] / (total * bounds[by])})
    return sorted(rows, key=lambda r: r["bound_s"])


def variants() -> dict[str, dict[str, Any]]:
    return {"elastic": policy("elastic"),
            "elastic-critical": {**policy("elastic", queue_order="critical"), "name": "elastic-critical"}}


def row_of(iso: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    return {"layout": run["devices"], "policy": run["policy"], "k": run["k"], "makespan_s": run["makespan_s"],
            "isolated_makespan_s": iso["makespan_s"], **bench.compare(iso, run),
            "action_wait_p99_s": run["action_wait_all_s"]["p99"], "completion_s": run["completion_s"]}


def show(r: dict[str, Any]) -> None:
    print(f"{r['layout']} {r['policy']:16s} k={r['k']:g}: {bench.against_ceiling(r)}; makespan {r['makespan_s']:.1f} "
          f"s, simulator stepping {r['simulator_stepping']:.3f}, action p99 {1000 * r['action_wait_p99_s']:.1f} ms",
          flush=True)


def alone(args) -> None:
    """``--alone``: each job of the workload alone on ``layouts.json``'s best split, one after another (the
    isolated admission, the best policy's other knobs). The longest job alone bounds the shared makespan as well:
    its chain of collections and updates cannot run faster with others beside it."""
    doc = json.loads(Path(args.out).read_text())
    layout, name = doc["best"]["layout"], doc["best"]["policy"]
    pol = {**variants()[name], "name": f"{name}-alone", "isolated": True}
    run = bench.run_layout(bench.paper_workload(), layout, args.k, [pol], rounds=args.rounds,
                           producers_per_sim=args.producers_per_sim, boot="isolated")[0]
    shared = next(r for r in doc["runs"] if (r["layout"], r["policy"]) == (layout, name))
    longest = max(run["job_s"], key=lambda j: run["job_s"][j])
    doc["alone"] = {"layout": layout, "policy": name, "k": args.k, "job_s": run["job_s"], "longest": longest,
                    "longest_s": run["job_s"][longest], "shared_makespan_s": shared["makespan_s"],
                    "command": "python experiments/paper_scale/layouts.py " + " ".join(sys.argv[1:])}
    print(f"alone on {layout} ({name}): " + ", ".join(f"{j} {t:.1f} s" for j, t in run["job_s"].items())
          + f"; the longest, {longest}, is {100 * run['job_s'][longest] / shared['makespan_s']:.1f} % of the shared "
          f"makespan {shared['makespan_s']:.1f} s", flush=True)
    Path(args.out).write_text(json.dumps(doc, indent=1, default=float))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=float, default=3.0)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--top", type=int, default=2, help="planned splits to run beside 2-2-4")
    ap.add_argument("--producers-per-sim", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each policy per service (the slower kept)")
    ap.add_argument("--ks", default="5,10,20", help="time scales for the best (split, policy)")
    ap.add_argument("--out", default=str(HERE / "layouts.json"))
    ap.add_argument("--alone", action="store_true", help="only: each job alone on the best split of --out, added "
                    "to it (alone)")
    args = ap.parse_args()
    if args.alone:
        return alone(args)
    t0, m = time.time(), args.producers_per_sim
    wl = bench.paper_workload()
    iso = bench.run_layout(wl, "1-1-2", args.k, [policy("isolated")])[0]  # steady: one round
    planned = plan(args.devices, iso, load_calibration(bench.CAL).dp_efficiency)
    for p in planned[:6]:
        print(f"plan {p['layout']}: bound {p['bound_s']:.1f} s by {p['bound_by']}, ceiling "
              f"{p['efficiency_ceiling']:.3f}", flush=True)
    layouts = list(dict.fromkeys([PAPER_LAYOUT, *[p["layout"] for p in planned[:args.top]]]))
    pols = variants()
    rows = []
    for layout in layouts:
        for run in bench.run_layout(wl, layout, args.k, list(pols.values()), rounds=args.rounds,
                                    producers_per_sim=m):
            rows.append(row_of(iso, run))
            show(rows[-1])
    best = max(rows, key=lambda r: r["efficiency"])
    sweep = [r for r in rows if r["layout"] == best["layout"]]
    for k in [float(x) for x in args.ks.split(",") if x and float(x) != args.k]:
        iso_k = bench.run_layout(wl, "1-1-2", k, [policy("isolated")])[0]
        for run in bench.run_layout(wl, best["layout"], k, list(pols.values()), rounds=args.rounds,
                                    producers_per_sim=m):
            sweep.append(row_of(iso_k, run))
            show(sweep[-1])
    spread = {f"{p}.{key}": (max(xs) - min(xs)) / (sum(xs) / len(xs))
              for p in pols for key in ("efficiency", "actor_util", "inference_util")
              if (xs := [r[key] for r in sweep if r["policy"] == p])}
    listed = ", ".join(f"{key} {100 * v:.1f} %" for key, v in spread.items())
    print(f"best: {best['layout']} {best['policy']}; k spread on {best['layout']}: {listed}", flush=True)
    for r in [*rows, *sweep]:
        r.pop("completion_s", None)
    doc = {"k": args.k, "producers_per_sim": m, "isolated": {key: iso[key] for key in (
        "makespan_s", "device_s", "busy_s", "utilization", "simulator_split_s")}, "plan": planned, "runs": rows,
        "best": {"layout": best["layout"], "policy": best["policy"]}, "k_sweep": sweep, "k_spread": spread,
        "meta": {"command": "python experiments/paper_scale/layouts.py " + " ".join(sys.argv[1:]),
                 "bench_s": time.time() - t0, "load_avg_end": os.getloadavg(), "cpu_count": os.cpu_count()}}
    Path(args.out).write_text(json.dumps(doc, indent=1, default=float))
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
