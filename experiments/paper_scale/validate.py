"""Does the emulation predict reality, out of sample? Calibrated from isolated real runs only, it predicts shared
real runs of another workload, with the mechanisms the emulator models (2 producers per simulator worker, split
RL batches, 2 collectors per job).

Calibration (frozen before anything is scored; ``calibrate.py``): ``calibrations/cpu_multitenant.toml``, the
service times of the *isolated* rounds of ``experiments/multitenant/results_cpu_calibration.json`` (3 RL + 1 SFT
tenants, each job alone, 4 episodes per batch, 1 collector, 1 producer per simulator worker, no split), and the
host CPU the real processes spend per request besides their device work (the same isolated rounds, less what the
emulated processes spend themselves in an isolated emulated run of that workload).

Scored workload (never used for calibration, ``SCORED``): the same four tenants with other job sizes, 8 episodes
per batch split over 2 rollout tasks, 2 collectors per job, 2 producers per simulator worker (2 SIM workers), all
four jobs at once under the default ``priority`` policy on a 1-1-2 service.

    python experiments/paper_scale/calibrate.py --host           # the frozen calibration (isolated runs only)
    python experiments/paper_scale/validate.py real --runs 3     # the real service on this CPU (~4 min idle)
    python experiments/paper_scale/validate.py predict --runs 3  # the emulator, both device models (~6 min idle)

On a host shared with other work, ``host_cpu`` predicts the run under the load the host has while it runs, as
the real run met its own: compare runs made under like load (each run records the load average).

``real`` writes the real runs into ``validation.json``; ``predict`` emulates them with device work that sleeps
(``device_work = "sleep"``: devices apart from the host, the emulator's model before) and with device work
spent on the host's cores (``"host_cpu"``), and writes each quantity's relative error of the medians: makespan and
the busy seconds of the actor, the inference engine and the simulators.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from emulated import EmulatedService, Job, Workload, policy  # noqa: E402

OUT = HERE / "validation.json"
CALIBRATION = "cpu_multitenant"
# per tenant, over the RL job below (the calibration's jobs: ms-state 8, ms-rgb 1, rs-lift 3 updates of 4 episodes,
# 1 collector, no split; SFT 300 steps)
SCORED: dict[str, dict[str, Any]] = {"ms-state": {"updates": 3}, "ms-rgb": {"updates": 1},
                                     "rs-lift": {"updates": 2}, "sft": {"steps": 200}}
RL = {"episodes_per_batch": 8, "collectors": 2, "split": 2}
PRODUCERS_PER_SIM, ENVS = 2, 4
# a loaded 2-core host starves heartbeats for a minute at times (env construction holds the interpreter): no worker
# is restarted for it mid-run, in the real or the emulated service
HEALTH = {"suspect_after_s": 300.0, "fail_after_s": 1800.0}
QUANTITIES = ("makespan_s", "actor_busy_s", "inference_busy_s", "simulator_busy_s")


def multitenant() -> Any:
    """``experiments/multitenant/bench.py`` (its tenants, warm-up and per-run accounting), under its own name."""
    spec = importlib.util.spec_from_file_location("multitenant_bench", ROOT / "experiments/multitenant/bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def jobs() -> dict[str, dict[str, Any]]:
    rl = {"kind": "rl", **RL, "ppo": {"update_epochs": 2, "minibatch_size": 64}}
    sft = {"kind": "sft", "batch_size": 32}
    return {n: {**(sft if n == "sft" else rl), **size} for n, size in SCORED.items()}


def quantities(makespan: float, busy: dict[str, float]) -> dict[str, float]:
    return {"makespan_s": makespan, "actor_busy_s": busy["actor"], "inference_busy_s": busy["inference"],
            "simulator_busy_s": busy["simulator"]}


def real(args: argparse.Namespace) -> None:
    """The scored workload on the real service (the tiny Qwen3-VL on this CPU): 2 SIM workers of 2 producers each."""
    from nexus.client.api import Nexus
    from nexus.deploy.local import LocalService
    from nexus.spec import TenantSpec

    mt = multitenant()
    mt.TENANTS.clear()
    mt.TENANTS.update(mt.WORKLOAD)
    mt.MIXES["scored"] = {n: {**size, **({} if n == "sft" else {"split": RL["split"]})} for n, size in SCORED.items()}
    margs = argparse.Namespace(updates=1, episodes=RL["episodes_per_batch"], collectors=RL["collectors"], envs=ENVS,
                               sft_steps=1, mix="scored")
    assert mt._jobs(margs) == jobs(), "the real and the emulated runs submit the same jobs"
    pol = policy("priority")
    t0 = time.time()
    runs = []
    with Nexus.local(Path(tempfile.mkdtemp(prefix="nexus-validate-")) / "service", scheduler="priority",
                     backbone={"device": "cpu", "dtype": "float32"}, datapath={"envs_per_producer": ENVS},
                     health=HEALTH,
                     service=lambda cfg: LocalService(cfg, n_sim=2, slots={"sim": PRODUCERS_PER_SIM})) as nx:
        workers = nx.service.client.scheduler_info()["workers"]
        mt.WORKER_NAMES.update({a: str(i.get("name", a)) for a, i in workers.items()})
        for name, (kw, _) in mt.TENANTS.items():
            nx.create_tenant(TenantSpec(name=name, hidden_dim=128, seed=len(name), **kw))
        mt.warm_up(nx, pol, margs)
        for r in range(args.runs):
            load = os.getloadavg()[0]
            res = mt.run_mode(nx, "multi", pol, margs)
            busy = {s: v["busy_s"] for s, v in res["accounting"]["services"].items()}
            runs.append({**quantities(res["makespan_s"], busy), "load_before": load, "load_after": os.getloadavg()[0],
                         "cpu_s": res["cpu_s"], "mean_group_rows": res["mean_group_rows"],
                         "simulator_split_s": res["simulator_split_s"]})
            print(f"real run {r}: " + ", ".join(f"{q} {runs[-1][q]:.1f}" for q in QUANTITIES)
                  + f"; load {load:.1f} -> {runs[-1]['load_after']:.1f}", flush=True)
            save_real(runs, t0)


def save_real(runs: list[dict], t0: float) -> None:
    """After every run: a run cut short by the host keeps the runs it made."""
    doc = json.loads(OUT.read_text()) if OUT.exists() else {}
    doc["real"] = {"runs": runs, "median": {q: statistics.median(r[q] for r in runs) for q in QUANTITIES},
                   "jobs": jobs(), "producers_per_sim": PRODUCERS_PER_SIM, "envs": ENVS,
                   "command": "python experiments/paper_scale/validate.py " + " ".join(sys.argv[1:]),
                   "bench_s": time.time() - t0, "cpu_count": os.cpu_count()}
    OUT.write_text(json.dumps(doc, indent=1, default=float))
    print(f"wrote {OUT}", flush=True)


def workload() -> Workload:
    mt = multitenant()
    return Workload("scored", [Job(n, {**mt.WORKLOAD[n][0], "hidden_dim": 128, "seed": len(n)}, job)
                               for n, job in jobs().items()], datapath={"envs_per_producer": ENVS})


def predict(args: argparse.Namespace) -> None:
    """The scored workload emulated with each device model, runs interleaved; errors of the medians."""
    doc = json.loads(OUT.read_text()) if OUT.exists() else {}
    if "real" not in doc and not args.wait_real:
        raise SystemExit(f"{OUT} has no real runs: run `validate.py real` first")
    t0 = time.time()
    pol = policy("priority")
    models = args.models.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in models}
    services = {m: EmulatedService(workload(), "1-1-2", CALIBRATION, 1.0, "priority",
                                   producers_per_sim=PRODUCERS_PER_SIM, emulation={"device_work": m})
                for m in models}
    try:
        for r in range(args.runs):
            for m in (models if r % 2 == 0 else models[::-1]):
                load = os.getloadavg()[0]
                res = services[m].run(pol)
                runs[m].append({**quantities(res["makespan_s"], res["busy_s"]), "load_before": load,
                                "load_after": os.getloadavg()[0], "mean_group_rows": res["mean_group_rows"],
                                "simulator_split_s": res["simulator_split_s"]})
                print(f"emulated {m:8s} run {r}: " + ", ".join(f"{q} {runs[m][-1][q]:.1f}" for q in QUANTITIES)
                      + f"; load {load:.1f}", flush=True)
            score(doc, runs, t0)  # after every round: a run cut short by the host keeps the rounds it made
    finally:
        for s in services.values():
            s.close()


def score(doc: dict, runs: dict[str, list[dict]], t0: float) -> None:
    """Each quantity's relative error of the medians, printed and written."""
    models = list(runs)
    real_now = json.loads(OUT.read_text()).get("real") if OUT.exists() else None  # they may still be running
    if real_now is None:  # nothing to score against yet: keep the emulated runs
        doc["emulated"] = {"runs": runs, "calibration": CALIBRATION, "bench_s": time.time() - t0}
        OUT.write_text(json.dumps(doc, indent=1, default=float))
        return
    doc["real"] = real_now
    meas = doc["real"]["median"]
    pred = {m: {q: statistics.median(r[q] for r in rs) for q in QUANTITIES} for m, rs in runs.items()}
    err = {m: {q: (p[q] - meas[q]) / meas[q] for q in QUANTITIES} for m, p in pred.items()}
    print(f"\n{'median of runs':22s}{'real':>10s}" + "".join(f"{m:>12s}{'error':>8s}" for m in models))
    for q in QUANTITIES:
        print(f"{q:22s}{meas[q]:10.2f}" + "".join(f"{pred[m][q]:12.2f}{100 * err[m][q]:+7.1f}%" for m in models))
    worst = {m: max(abs(e) for e in err[m].values()) for m in models}
    print("largest |error|: " + ", ".join(f"{m} {100 * w:.1f} %" for m, w in worst.items()) + " (target <= 15 %)")
    doc["emulated"] = {"runs": runs, "median": pred, "relative_error": err, "largest_abs_error": worst,
                       "calibration": CALIBRATION,
                       "command": "python experiments/paper_scale/validate.py " + " ".join(sys.argv[1:]),
                       "bench_s": time.time() - t0}
    OUT.write_text(json.dumps(doc, indent=1, default=float))
    print(f"wrote {OUT}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("real", help="the scored workload on the real service")
    r.add_argument("--runs", type=int, default=3)
    p = sub.add_parser("predict", help="the scored workload emulated")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--wait-real", action="store_true", help="start before the real runs are written (they are "
                   "read when scored)")
    p.add_argument("--models", default="sleep,host_cpu", help="device_work values compared")
    args = ap.parse_args()
    {"real": real, "predict": predict}[args.cmd](args)


if __name__ == "__main__":
    main()
