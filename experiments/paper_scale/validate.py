"""Does the emulation predict reality? The real small-scale run emulated from its own calibration.

``calibrations/cpu_multitenant.toml`` holds the service times the real CPU run measured (``calibrate.py``,
from ``experiments/multitenant/results_cpu_calibration.json``). Here the same workload — 3 RL tenants (ManiSkill
state, ManiSkill rgb, robosuite Lift) + 1 SFT tenant, the equal-time job sizes, K = 4, one producer per RL
job, isolated vs the default policy — runs on an emulated service with the real run's devices (1 actor,
1 engine, 2 simulators) at time scale 1, and its efficiency and utilizations are compared with that real run's
medians. ``validation_error`` is the largest relative error over the efficiency and the actor and inference
utilizations of both modes.

    python experiments/paper_scale/validate.py       # ~3 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from emulated import EmulatedService, Job, Workload, policy  # noqa: E402

SOURCE = ROOT / "experiments/multitenant/results_cpu_calibration.json"


def workload(doc: dict) -> Workload:
    meta = doc["meta"]
    jobs = [Job(name, {**spec, "hidden_dim": 128, "seed": len(name)}, meta["jobs"][name])
            for name, (spec, _) in meta["tenant_specs"].items()]
    return Workload("multitenant", jobs, datapath={"envs_per_producer": meta["envs"]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results.json"))
    args = ap.parse_args()
    t0 = time.time()
    doc = json.loads(SOURCE.read_text())
    shared_name = doc["meta"]["policies"].split(",")[0]
    real = doc["summary"]["median"]
    real_eff = doc["summary"]["efficiency"][shared_name]["median"]
    wl = workload(doc)
    svc = EmulatedService(wl, f"1-1-{doc['meta']['n_sim']}", "cpu_multitenant", 1.0, "isolated")
    runs: dict[str, list[dict]] = {"isolated": [], shared_name: []}
    try:
        for r in range(args.rounds):
            for mode in (["isolated", shared_name] if r % 2 == 0 else [shared_name, "isolated"]):
                run = svc.run(policy(mode))
                run.pop("spans")
                runs[mode].append(run)
                u = run["utilization"]
                print(f"round {r} {mode:9s} makespan {run['makespan_s']:6.1f} s util actor {u['actor']:.3f} "
                      f"inference {u['inference']:.3f} simulator {u['simulator']:.3f}", flush=True)
    finally:
        svc.close()
    eff = statistics.median(i["device_s"] / s["device_s"] for i, s in zip(runs["isolated"], runs[shared_name],
                                                                          strict=True))
    pred: dict[str, float] = {"efficiency": eff}
    meas: dict[str, float] = {"efficiency": real_eff}
    for mode in ("isolated", shared_name):
        for s in ("actor", "inference", "simulator"):
            pred[f"{mode}.{s}"] = statistics.median(r["utilization"][s] for r in runs[mode])
            meas[f"{mode}.{s}"] = real[mode]["utilization"][s]
        pred[f"{mode}.makespan_s"] = statistics.median(r["makespan_s"] for r in runs[mode])
        meas[f"{mode}.makespan_s"] = real[mode]["makespan_s"]
    err = {m: abs(pred[m] - meas[m]) / meas[m] for m in pred if meas[m] > 0}
    scored = ["efficiency", *(f"{m}.{s}" for m in ("isolated", shared_name) for s in ("actor", "inference"))]
    validation_error = max(err[m] for m in scored)
    print(f"\n{'':28s}{'real':>10s}{'emulated':>10s}{'error':>8s}")
    for m in pred:
        print(f"{m:28s}{meas[m]:10.3f}{pred[m]:10.3f}{100 * err[m]:7.1f}%{'  *' if m in scored else ''}")
    print(f"validation error (largest of *): {100 * validation_error:.1f} % (target <= 15 %)")
    out = Path(args.out)
    res = json.loads(out.read_text()) if out.exists() else {}
    res["validation"] = {"real": meas, "emulated": pred, "relative_error": err, "scored": scored,
                         "validation_error": validation_error, "runs": runs,
                         "meta": {"command": "python experiments/paper_scale/validate.py " + " ".join(sys.argv[1:]),
                                  "source": str(SOURCE.relative_to(ROOT)), "calibration": "cpu_multitenant",
                                  "load_avg_end": os.getloadavg(), "bench_s": time.time() - t0}}
    res["validation_error"] = validation_error
    out.write_text(json.dumps(res, indent=1, default=float))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
