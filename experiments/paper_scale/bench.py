"""Sharing against an equally optimized baseline, on emulated devices (``nexus.emulator``), for a workload file.

Every run is the real service — scheduler plugin, training queue, inference queue and group batching, Dask
task graph, engine pool and routing, weight-sync messages — through the public client (``emulated.py``), with
actor updates, forwards and simulator steps taking the calibrated times of the workload's calibration divided
by the time scale k. A workload (``workloads/*.toml``, read once by ``workload.py``) names its tenants and
jobs, the shared server (2-2-4 for the paper) and the isolated baseline (each job alone on 1-1-2, one after
another), and the mechanism settings both may try.

``compare``: (1) **tuning** — both modes run every candidate of ``[tuning]`` on the calibration seed and keep the
one of fewest device-seconds (the same tries for each); (2) **scoring** — the two frozen configurations run on
each score seed, isolated and shared in turn; efficiency = isolated device time / shared device time (devices x
wall), per seed; median and a 95 % bootstrap interval of the median; (3) ``--attribution``: each mechanism off
and on from each mode's frozen configuration (on one score seed): its own gain; (4) ``--k-check K``: the frozen
pair again at another time scale.

    python experiments/paper_scale/bench.py compare --workload paper_exp1 --k 5 --attribution --k-check 3
    python experiments/paper_scale/bench.py compare --workload bursty --k 5
    python experiments/paper_scale/bench.py validate   # validate.py: the real CPU run emulated
    python experiments/paper_scale/bench.py calibrate  # calibrate.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from emulated import EmulatedService, Job, Workload, policy  # noqa: E402
from workload import Mechanisms, WorkloadFile, load  # noqa: E402

from nexus.emulator.settings import DeviceCounts, load_calibration  # noqa: E402

PAPER = {"efficiency": 1.39, "actor_util": (0.208, 0.413), "inference_util": (0.281, 0.375)}
MODES = ("isolated", "shared")
MECHANISMS = ("producers_per_sim", "rollout_split", "lend_actor", "lend_inference", "infer_max_batch", "max_inflight")


class Services:
    """Emulated services by (mode, device settings); at most ``keep`` alive (the oldest closed first)."""

    def __init__(self, wf: WorkloadFile, k: float, keep: int = 2) -> None:
        self.wf, self.k, self.keep = wf, k, keep
        self.alive: dict[tuple, EmulatedService] = {}

    def get(self, mode: str, mech: Mechanisms) -> EmulatedService:
        m = getattr(self.wf, mode)
        key = (mode, mech.producers_per_sim, mech.lend_actor, mech.lend_inference)
        if key not in self.alive:
            while len(self.alive) >= self.keep:
                self.alive.pop(next(iter(self.alive))).close()
            emu = {"lend_actor": mech.lend_actor, "lend_inference": mech.lend_inference}
            wl = Workload(self.wf.name, [], {"envs_per_producer": self.wf.envs_per_producer})
            self.alive[key] = EmulatedService(wl, m.devices, self.wf.calibration, self.k, m.policy,
                                              actor_group=m.actor_group, producers_per_sim=mech.producers_per_sim,
                                              emulation=emu)
        else:
            self.alive[key] = self.alive.pop(key)  # the newest used
        return self.alive[key]

    def close(self) -> None:
        while self.alive:
            self.alive.popitem()[1].close()


def scheduler(wf: WorkloadFile, mode: str, mech: Mechanisms) -> dict[str, Any]:
    m = getattr(wf, mode)
    return policy(m.policy, **m.settings, rollout_split=mech.rollout_split, rollout_split_rule="always",
                  infer_max_batch=mech.infer_max_batch, default_max_inflight=mech.max_inflight)


def run_once(svcs: Services, mode: str, mech: Mechanisms, seed: int) -> dict[str, Any]:
    """One run of the workload drawn for ``seed`` (tenants of their own, seeded) in ``mode`` with ``mech``."""
    wf, k = svcs.wf, svcs.k
    jobs = [Job(f"{d['tenant']}-s{seed}", d["spec"], d["job"], d["arrival_s"] / k) for d in wf.draw(seed)]
    r = svcs.get(mode, mech).run(scheduler(wf, mode, mech), jobs, serial=mode == "isolated")
    m = getattr(wf, mode)
    dev = DeviceCounts.parse(m.devices)
    group = m.actor_group or dev.actor
    dp = load_calibration(wf.calibration).dp_efficiency ** math.log2(group) if group > 1 else 1.0
    wall = r["makespan_s"]
    # single-device work: an update on a data-parallel group of g devices counts the time it takes one device
    # (busy x dp_efficiency^log2 g), not the group's overhead
    single = {"actor": r["busy_s"]["actor"] * dp, "inference": r["busy_s"]["inference"],
              "simulator": r["busy_s"]["simulator"]}
    out = {"mode": mode, "mechanisms": mech.model_dump(), "seed": seed, "k": k, "devices": m.devices,
           "device_s": r["device_s"], "makespan_s": wall, "busy_s": r["busy_s"], "slots": r["slots"],
           "utilization": r["utilization"],
           "utilization_single_device": {s: single[s] / max(r["slots"][s] * wall, 1e-9) for s in single},
           "mean_group_rows": r["mean_group_rows"], "mixed_group_share": r["cross_tenant_share"],
           "action_wait_p99_s": r["action_wait_all_s"]["p99"], "job_s": r["job_s"], "response_s": r["response_s"],
           "busy_le_wall": r["busy_le_wall"], "load_avg": os.getloadavg()[0]}
    u = out["utilization_single_device"]
    print(f"  {mode:8s} seed {seed:3d} {mech.label():38s} device {out['device_s']:8.1f} s  makespan {wall:6.1f} s  "
          f"util (single-device) actor {u['actor']:.2f} inference {u['inference']:.2f} simulator "
          f"{u['simulator']:.2f}  groups {out['mean_group_rows']:.1f} rows, {100 * out['mixed_group_share']:.0f} % "
          f"mixed  load {out['load_avg']:.1f}; ends {' '.join(f'{n}:{t:.0f}' for n, t in r['completion_s'].items())}",
          flush=True)
    return out


def interval(xs: list[float], n: int = 10000, seed: int = 0) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval of the median."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def summary(xs: list[float]) -> dict[str, Any]:
    lo, hi = interval(xs)
    return {"median": statistics.median(xs), "ci95": [lo, hi], "n": len(xs), "min": min(xs), "max": max(xs),
            "values": xs}


def tune(svcs: Services, wf: WorkloadFile, picks: list[int]) -> dict[str, Any]:
    """Each mode runs the same candidates (``picks``: their indices) on the calibration seed; the fewest
    device-seconds wins."""
    seed = wf.tuning.calibration_seed
    cands = [wf.tuning.candidates[i] for i in picks]
    got: dict[str, list[tuple[float, Mechanisms]]] = {m: [] for m in MODES}
    for c in cands:
        for mode in MODES:
            got[mode].append((run_once(svcs, mode, c, seed)["device_s"], c))
    frozen = {m: min(got[m], key=lambda t: t[0])[1] for m in MODES}
    return {"seed": seed, "tries": len(cands),
            "device_s": {m: {c.label(): d for d, c in got[m]} for m in MODES}, "frozen": frozen}


def score(svcs: Services, frozen: dict[str, Mechanisms], seeds: list[int]) -> list[dict[str, Any]]:
    runs = []
    for s in seeds:  # isolated and shared in turn, so host noise falls on both
        iso, sh = run_once(svcs, "isolated", frozen["isolated"], s), run_once(svcs, "shared", frozen["shared"], s)
        runs.append({"seed": s, "isolated": iso, "shared": sh, "efficiency": iso["device_s"] / sh["device_s"]})
        print(f"  seed {s}: efficiency {runs[-1]['efficiency']:.3f}", flush=True)
    return runs


def attribution(svcs: Services, frozen: dict[str, Mechanisms], runs: list[dict[str, Any]], names: list[str],
                save: Any) -> dict[str, Any]:
    """Each mechanism's own gain in each mode: device time with it off over device time with it on, the rest of
    the mode's frozen configuration kept (the frozen run of the first score seed is one of the two)."""
    seed = runs[0]["seed"]
    out: dict[str, Any] = {"seed": seed, "modes": {}}
    for name in names:
        for mode in MODES:
            base = frozen[mode]
            done = {base.label(): runs[0][mode]["device_s"], **out.setdefault("_done", {}).setdefault(mode, {})}
            off, on = base.toggled(name)
            for c in (off, on):
                if c.label() not in done:
                    done[c.label()] = run_once(svcs, mode, c, seed)["device_s"]
            out["_done"][mode] = done
            out["modes"].setdefault(mode, {})[name] = {
                "off": off.label(), "on": on.label(), "off_device_s": done[off.label()],
                "on_device_s": done[on.label()], "gain": done[off.label()] / done[on.label()],
                "frozen_has_it": on == base}
            save(out)
    return out


def table(section: dict[str, Any]) -> str:
    h, lines = section["headline"], []
    runs = ", ".join(f"{x:.3f}" for x in h["values"])
    lines.append(f"{section['workload']}: sharing alone, efficiency median {h['median']:.3f} (95 % interval "
                 f"{h['ci95'][0]:.3f}-{h['ci95'][1]:.3f}, n = {h['n']}; runs {runs})")
    for mode in MODES:
        f = section["frozen"][mode]
        u = section["utilization_single_device"][mode]
        lines.append(f"  {mode:8s} frozen {Mechanisms(**f).label():38s} util (single-device, median) actor "
                     f"{u['actor']:.3f} inference {u['inference']:.3f} simulator {u['simulator']:.3f}; groups "
                     f"{section['groups'][mode]['mean_rows']:.1f} rows, "
                     f"{100 * section['groups'][mode]['mixed_share']:.0f} % mixed")
    for k, v in section.get("k_check", {}).items():
        lines.append(f"  k = {k}: efficiency {', '.join(f'{x:.3f}' for x in v['values'])}")
    if "attribution" in section:
        lines.append("  mechanism        | gain alone (isolated) | gain shared")
        a = section["attribution"]["modes"]
        for name in [n for n in MECHANISMS if n in a.get("shared", {})]:
            cells = [f"{a[m][name]['gain']:.3f}{'*' if a[m][name]['frozen_has_it'] else ' '}" for m in MODES]
            lines.append(f"  {name:16s} | {cells[0]:21s} | {cells[1]}")
        lines.append("  (* on in that mode's frozen configuration)")
    return "\n".join(lines)


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Tuning, scoring, attribution and the k check, the section saved after each (a cut run keeps what it did)."""
    wf = load(args.workload)
    seeds = wf.tuning.score_seeds[:args.runs] if args.runs else wf.tuning.score_seeds
    picks = [int(x) for x in args.candidates.split(",")] if args.candidates else list(range(len(wf.tuning.candidates)))
    t0 = time.time()
    section: dict[str, Any] = {"workload": wf.name, "description": wf.description, "k": args.k,
                               "calibration": wf.calibration, "paper": PAPER}

    def save(part: dict[str, Any] | None = None) -> None:
        section.update(part or {})
        section["meta"] = {"command": "python experiments/paper_scale/bench.py " + " ".join(sys.argv[1:]),
                           "cpu_count": os.cpu_count(), "load_avg_end": os.getloadavg(), "bench_s": time.time() - t0}
        out = Path(args.out)
        doc = json.loads(out.read_text()) if out.exists() else {}
        doc[args.section or wf.name] = section
        out.write_text(json.dumps(doc, indent=1, default=float))

    svcs = Services(wf, args.k, keep=args.keep)
    try:
        if args.frozen:
            fz = json.loads(Path(args.out).read_text())[args.frozen]["frozen"]
            frozen = {m: Mechanisms(**fz[m]) for m in MODES}
            save({"tuning": {"from": args.frozen, "frozen": {m: frozen[m].model_dump() for m in MODES}}})
        else:
            print(f"{wf.name}: tuning both modes on seed {wf.tuning.calibration_seed} (k = {args.k:g})", flush=True)
            tuned = tune(svcs, wf, picks)
            frozen = tuned["frozen"]
            save({"tuning": {**tuned, "frozen": {m: frozen[m].model_dump() for m in MODES}}})
        section["frozen"] = {m: frozen[m].model_dump() for m in MODES}
        print(f"frozen: isolated {frozen['isolated'].label()}, shared {frozen['shared'].label()}; scoring seeds "
              f"{seeds}", flush=True)
        runs = score(svcs, frozen, seeds)
        save({"headline": summary([r["efficiency"] for r in runs]),
              "utilization_single_device": {m: {s: statistics.median(r[m]["utilization_single_device"][s]
                                                                     for r in runs)
                                                for s in ("actor", "inference", "simulator")} for m in MODES},
              "groups": {m: {"mean_rows": statistics.median(r[m]["mean_group_rows"] for r in runs),
                             "mixed_share": statistics.median(r[m]["mixed_group_share"] for r in runs)}
                         for m in MODES},
              "runs": runs})
        print(table(section), flush=True)
        if args.attribution:
            names = args.attribution.split(",") if args.attribution != "all" else list(MECHANISMS)
            attribution(svcs, frozen, runs, names, lambda a: save({"attribution": {
                "seed": a["seed"], "modes": a["modes"]}}))
    finally:
        svcs.close()
    section["k_check"] = {}
    for k2 in [float(x) for x in args.k_check.split(",") if x]:
        svcs = Services(wf, k2, keep=2)
        try:
            ks = [r["efficiency"] for r in score(svcs, frozen, seeds[:args.k_check_runs])]
        finally:
            svcs.close()
        section["k_check"][f"{k2:g}"] = {"values": ks, "median": statistics.median(ks),
                                         "same_seeds_at_k": [r["efficiency"] for r in runs[:args.k_check_runs]]}
        save()
    return section


def main() -> None:
    if sys.argv[1:2] in (["validate"], ["calibrate"]):  # the other subcommands live in helper modules
        import importlib

        helper = importlib.import_module(sys.argv[1])
        sys.argv = [str(HERE / f"{sys.argv[1]}.py"), *sys.argv[2:]]
        helper.main()
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("compare",), help="also: validate, calibrate (each with its own --help)")
    ap.add_argument("--workload", required=True, help="a workload TOML file, or a name in workloads/")
    ap.add_argument("--k", type=float, default=5.0, help="time scale: every service time divided by k")
    ap.add_argument("--candidates", default="", help="the tuning candidates both modes try, by index (default: all)")
    ap.add_argument("--keep", type=int, default=3, help="emulated services kept up at once")
    ap.add_argument("--runs", type=int, default=0, help="score seeds to run (0: all the workload's)")
    ap.add_argument("--frozen", default=None, help="skip tuning: take the frozen configurations of this "
                    "results.json section (tuned before on the calibration seed)")
    ap.add_argument("--attribution", default="", help="mechanisms to turn off and on in both modes, in order "
                    "(comma-separated, or all)")
    ap.add_argument("--k-check", default="", help="other time scales to rerun the frozen pair at, e.g. 3")
    ap.add_argument("--k-check-runs", type=int, default=2)
    ap.add_argument("--section", default=None, help="results.json section (default: the workload's name)")
    ap.add_argument("--out", default=str(HERE / "results.json"))
    args = ap.parse_args()
    t0 = time.time()
    section = compare(args)
    print(table(section))
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
