"""How close the best policy comes to what fixed roles allow, and whether the obvious levers move it.

The paper's workload (``bench.py paper``) on a split of the 8 devices (``--layout``: the paper's 2-2-4, or
``layouts.py``'s best, 1-2-5) with ``elastic`` and simulator devices running m producers, against the paper's
isolated 1-1-2, at k = 3, on one emulated service per variant (``--rounds`` each, the slower kept); each variant
prints its efficiency and utilizations next to their **ceiling** (``bench.ceiling``: the busiest service's work
on its own devices, every one busy all the time, bounds the makespan) and how much of that bound the run reached.
Variants (``--variants``, ``;``-separated ``m,split,inflight`` then optional ``rule``, or ``key=value`` among
``rule``, ``order``, ``batch``, ``wait``, ``route``, ``place``, ``lend``, ``lendinf``): m producers per simulator
device, ``elastic``'s ``rollout_split``, the RL tenants' ``max_inflight`` (0: the policy's default, 2; a third batch in
flight overlaps a job's rollouts with its updates — the isolated baseline is run again with it, since it helps a tenant
alone too), ``rollout_split_rule`` (default: ``elastic``'s), the training queue's order (``queue_order``), the inference
group's size B and wait T (``infer_max_batch``, ``infer_max_wait_s``), the tenants' routing to engines (``routing``:
``static`` or by ``load``), who gets a freed simulator place (``sim``: ``fair``, the default, or ``critical``:
``sim_order``), and the simulator device a producer takes (``place``: ``fewest`` producers, the default,
or least ``load``; ``EmulationSettings.sim_placement``), and whether the actor lends its idle devices to the
simulators (``lend``: ``off``, the default, or ``on``; ``EmulationSettings.lend_actor``) and whether the engines lend
theirs, running their forwards there first (``lendinf``: ``off`` or ``on``; ``lend_inference``). With lending, the
isolated baseline is run once more with the same lending (it does not help a job alone), unless
``--no-lending-baseline``.

    python experiments/paper_scale/levers.py    # ~10 min on 2 cores -> levers.json
    python experiments/paper_scale/levers.py --layout 1-2-5 --rounds 2 --out experiments/paper_scale/levers_1-2-5.json \
        --variants "2,4,0,order=critical;2,4,0;2,4,0,order=critical,batch=32,wait=0.005;3,4,0,order=critical;\
2,4,3,order=critical"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, get_args

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402
from emulated import Workload, policy  # noqa: E402

from nexus.emulator.settings import EmulationSettings  # noqa: E402


def workload(inflight: int) -> Workload:
    wl = bench.paper_workload()
    for j in wl.jobs:
        if inflight and j.job["kind"] == "rl":
            j.spec["max_inflight"] = inflight
    return wl


KNOBS = {"rule": "rollout_split_rule", "order": "queue_order", "batch": "infer_max_batch", "wait": "infer_max_wait_s",
         "route": "routing", "place": "sim_placement", "lend": "lend_actor", "lendinf": "lend_inference",
         "sim": "sim_order"}
PLACEMENTS = get_args(EmulationSettings.model_fields["sim_placement"].annotation)  # the setting's own choices
SWITCH = {"on": True, "off": False}


def parse_variant(text: str) -> tuple[int, int, int, dict[str, Any], dict[str, Any]]:
    """``m,split,inflight[,rule][,key=value...]`` -> (m, split, inflight, the policy's overrides, the emulated
    devices' settings: ``place``, ``lend`` and ``lendinf`` are not the policy's)."""
    fields = text.split(",")
    try:
        m, split, inflight = (int(x) for x in fields[:3])
    except ValueError:
        raise SystemExit(f"variant {text!r}: expected m,split,inflight (integers) first") from None
    over: dict[str, Any] = {}
    devices = bench.device_settings(None)
    for f in fields[3:]:
        key, _, value = f.partition("=") if "=" in f else ("rule", "=", f)
        if key not in KNOBS:
            raise SystemExit(f"variant {text!r}: unknown lever {key!r} (known: {', '.join(KNOBS)})")
        if key in ("place", "lend", "lendinf"):
            choices = PLACEMENTS if key == "place" else tuple(SWITCH)
            if value not in choices:
                raise SystemExit(f"variant {text!r}: {key}={value!r} (known: {', '.join(choices)})")
            devices[KNOBS[key]] = value if key == "place" else SWITCH[value]
            continue
        try:
            over[KNOBS[key]] = int(value) if key == "batch" else float(value) if key == "wait" else value
        except ValueError:
            raise SystemExit(f"variant {text!r}: {key}={value!r} is not a number") from None
    return m, split, inflight, over, devices


def actor_idle(run: dict[str, Any], split_at: float) -> dict[str, float]:
    """Seconds of the run in which no actor device worked, before and after ``split_at`` (seconds since its start;
    the SFT job's end: until then its steps are the filler the RL tenants' gaps can take)."""
    spans = sorted((s["t0"] - run["t0"], s["t1"] - run["t0"]) for s in run["spans"] if s["service"] == "actor")
    idle, end = [0.0, 0.0], 0.0
    for a, b in [*spans, (run["makespan_s"], run["makespan_s"])]:
        if a > end:
            idle[0] += max(0.0, min(a, split_at) - end)
            idle[1] += max(0.0, a - max(end, split_at))
        end = max(end, b)
    return {"before_sft_end": idle[0], "after_sft_end": idle[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=float, default=3.0)
    ap.add_argument("--layout", default="2-2-4", help="the shared server's actor-inference-simulator split")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each variant (the slower kept)")
    ap.add_argument("--variants", default="2,4,0;2,4,0,free;3,4,0;3,6,0;2,4,3",
                    help="m,split,inflight[,rule][,order=..,batch=..,wait=..] per variant (the first is elastic as "
                    "bench.py paper_shared_sims runs it)")
    ap.add_argument("--out", default=str(HERE / "levers.json"))
    ap.add_argument("--no-lending-baseline", action="store_true", help="with lending, do not run the isolated "
                    "baseline with the same lending too (~100 s at k = 3)")
    args = ap.parse_args()
    t0 = time.time()
    variants = [parse_variant(v) for v in args.variants.split(";") if v]
    iso: dict[tuple[int, tuple[bool, bool]], dict[str, Any]] = {}
    rows = []
    for m, split, inflight, over, devices in variants:
        pol = policy("elastic", rollout_split=split, **over)
        wl = workload(inflight)
        place = devices["sim_placement"]
        lend = (devices["lend_actor"], devices["lend_inference"])
        baselines = [(False, False)] + ([lend] if any(lend) and not args.no_lending_baseline else [])
        for lends in baselines:  # the paper's baseline; and, for lending, one whose devices lend too
            if (inflight, lends) not in iso:
                iso[inflight, lends] = bench.run_layout(
                    wl, "1-1-2", args.k, [policy("isolated")],
                    emulation={"lend_actor": lends[0], "lend_inference": lends[1]})[0]
        i, il = iso[inflight, (False, False)], iso.get((inflight, lend))
        shared = bench.run_layout(wl, args.layout, args.k, [pol], rounds=args.rounds, producers_per_sim=m,
                                  emulation=devices)[0]
        row = {"layout": args.layout, "producers_per_sim": m, **devices, "rollout_split": split,
               "max_inflight": inflight or 2,
               "rule": pol["rollout_split_rule"], "queue_order": pol["queue_order"], "sim_order": pol["sim_order"],
               "routing": pol["routing"],
               "infer_max_batch": pol["infer_max_batch"], "infer_max_wait_s": pol["infer_max_wait_s"],
               "isolated_makespan_s": i["makespan_s"], "isolated_device_s": i["device_s"],
               "makespan_s": shared["makespan_s"], "device_s": shared["device_s"],
               "rounds_device_s": shared["rounds_device_s"], **bench.compare(i, shared),
               "completion_s": shared["completion_s"], "action_wait_p99_s": shared["action_wait_all_s"]["p99"],
               "actor_idle_s": actor_idle(shared, shared["completion_s"]["sft"]),
               "lent_stepping_s": sum(s.get("lent_s", 0.0) for s in shared["spans"] if s["service"] == "simulator"),
               "lent_missed_s": sum(s.get("lent_missed_s", 0.0) for s in shared["spans"]),
               **({"isolated_lending_device_s": il["device_s"],
                   "efficiency_vs_isolated_lending": il["device_s"] / shared["device_s"]} if il else {})}
        rows.append(row)
        lenders = " and ".join(s for s, on in zip(("actor", "engines"), lend, strict=True) if on)
        print(f"{args.layout} m={m} ({place}{f', {lenders} lend' if lenders else ''}) split={split} ({row['rule']}, "
              f"{row['queue_order']}, sims {row['sim_order']}, B={row['infer_max_batch']}) "
              f"inflight={row['max_inflight']}: {bench.against_ceiling(row)}; makespan {row['makespan_s']:.1f} s, "
              f"isolated {i['makespan_s']:.1f} s, action p99 {1000 * row['action_wait_p99_s']:.1f} ms, actor idle "
              f"{row['actor_idle_s']['before_sft_end']:.1f} s before the SFT job's end, "
              f"{row['actor_idle_s']['after_sft_end']:.1f} s after"
              + (f", {row['lent_stepping_s']:.1f} s stepped on lent devices ({row['lent_missed_s']:.2f} s of forwards "
                 "heard of too late to push them back)" if lenders else "")
              + (f"; against an isolated run whose devices lend too ({il['makespan_s']:.1f} s): "
                 f"{row['efficiency_vs_isolated_lending']:.3f}" if il and lenders else ""), flush=True)
    doc = {"variants": rows, "k": args.k, "layout": args.layout, "rounds": args.rounds, "meta": {
        "command": "python experiments/paper_scale/levers.py " + " ".join(sys.argv[1:]), "bench_s": time.time() - t0,
        "load_avg_end": os.getloadavg(), "cpu_count": os.cpu_count()}}
    Path(args.out).write_text(json.dumps(doc, indent=1, default=float))
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
