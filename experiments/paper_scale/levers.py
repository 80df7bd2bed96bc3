"""How close the best policy comes to what fixed roles allow, and whether the obvious levers move it.

The paper's workload (``bench.py paper``) on 2-2-4 with ``elastic`` and simulator devices running m producers,
against the paper's isolated 1-1-2, one round each at k = 3, on one emulated service per layout; each variant
prints its efficiency and utilizations next to their **ceiling** (``bench.ceiling``: the workload's simulator
stepping on the 4 simulator devices, every one stepping all the time, bounds the makespan) and how much of that
bound the run reached. Variants (``--variants``, ``;``-separated ``m,split,inflight[,rule]``): m producers per
simulator device, ``elastic``'s ``rollout_split``, the RL tenants' ``max_inflight`` (0: the policy's default, 2;
a third batch in flight overlaps a job's rollouts with its updates — the isolated baseline is run again with it,
since it helps a tenant alone too) and ``rollout_split_rule`` (default: ``elastic``'s).

    python experiments/paper_scale/levers.py    # ~10 min on 2 cores -> levers.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402
from emulated import Workload, policy  # noqa: E402


def workload(inflight: int) -> Workload:
    wl = bench.paper_workload()
    for j in wl.jobs:
        if inflight and j.job["kind"] == "rl":
            j.spec["max_inflight"] = inflight
    return wl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=float, default=3.0)
    ap.add_argument("--variants", default="2,4,0;2,4,0,free;3,4,0;3,6,0;2,4,3",
                    help="m,split,inflight[,rule] per variant (the first is elastic as bench.py paper_shared_sims "
                    "runs it)")
    ap.add_argument("--out", default=str(HERE / "levers.json"))
    args = ap.parse_args()
    t0 = time.time()
    variants = [v.split(",") for v in args.variants.split(";") if v]
    iso: dict[int, dict[str, Any]] = {}
    rows = []
    for fields in variants:
        m, split, inflight = (int(x) for x in fields[:3])
        rule = fields[3] if len(fields) > 3 else policy("elastic")["rollout_split_rule"]
        wl = workload(inflight)
        if inflight not in iso:
            iso[inflight] = bench.run_layout(wl, "1-1-2", args.k, [policy("isolated")])[0]
        i = iso[inflight]
        shared = bench.run_layout(wl, "2-2-4", args.k, [policy("elastic", rollout_split=split,
                                                              rollout_split_rule=rule)], producers_per_sim=m)[0]
        row = {"producers_per_sim": m, "rollout_split": split, "max_inflight": inflight or 2, "rule": rule,
               "isolated_makespan_s": i["makespan_s"], "isolated_device_s": i["device_s"],
               "makespan_s": shared["makespan_s"], "device_s": shared["device_s"], **bench.compare(i, shared),
               "completion_s": shared["completion_s"], "action_wait_p99_s": shared["action_wait_all_s"]["p99"]}
        rows.append(row)
        print(f"m={m} split={split} ({rule}) inflight={row['max_inflight']}: {bench.against_ceiling(row)}; makespan "
              f"{row['makespan_s']:.1f} s, isolated {i['makespan_s']:.1f} s", flush=True)
    doc = {"variants": rows, "k": args.k, "meta": {
        "command": "python experiments/paper_scale/levers.py " + " ".join(sys.argv[1:]), "bench_s": time.time() - t0,
        "load_avg_end": os.getloadavg(), "cpu_count": os.cpu_count()}}
    Path(args.out).write_text(json.dumps(doc, indent=1, default=float))
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
