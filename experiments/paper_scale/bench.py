"""The paper's Exp. 1 at its scale, and beyond it, on emulated devices (``nexus.emulator``).

Every run is the real service — scheduler plugin, training queue, inference queue and group batching, Dask
task graph, engine pool and routing, weight-sync messages, health — with actor updates, inference
forwards and simulator steps taking the calibrated times of ``calibrations/paper_gpu.toml`` divided by the
time scale k. Devices are lanes of one worker per service (``nexus.emulator.lanes``).

``paper``: 3 RL tenants (robosuite Lift standing in for LIBERO, ManiSkill PushCube state, ManiSkill
PickCube rgb) + 1 SFT tenant. Isolated: the ``isolated`` policy on a 1-1-2 service (each tenant's jobs alone,
one after another: the paper's baseline); shared: each policy on a 2-2-4 service. Efficiency = isolated /
shared device time (slots x wall). Then the k sweep: the isolated run and the default and best policies
again at each k, on fresh services. ``--producers-per-sim m`` lets each simulator device of the shared server run
m producers whose steps take turns (``--isolated-like-shared``: the isolated baseline too, with ``elastic``'s
batch split).

``large``: 64 devices (8 servers: 16-16-32, actor groups of 2, 8 updates at once), 32 tenants: 10 long RL
jobs at the start and 22 short SFT jobs arriving as a Poisson process; device time against each job alone on
a 1-1-2 server (each distinct job measured once, one after another), per-tenant queueing delay (training
queue, action requests) p50/p99, Jain fairness of each tenant's isolated time / its response time.

    python experiments/paper_scale/bench.py paper --k 2 --ks 2,3,5,10,20   # ~35 min on 2 loaded cores
    python experiments/paper_scale/bench.py large                         # ~20 min
    python experiments/paper_scale/bench.py validate   # the real CPU run emulated (validate.py) -> results.json
    python experiments/paper_scale/bench.py calibrate  # calibrations/cpu_multitenant*.toml (calibrate.py)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from emulated import EmulatedService, Job, Workload, jain, knob, pct, policy  # noqa: E402

from nexus.emulator.settings import EmulationSettings  # noqa: E402

PAPER = {"efficiency": 1.39, "device_time_saved": 0.283, "actor_util": (0.208, 0.413),
         "inference_util": (0.281, 0.375)}
TARGETS = {"efficiency": 1.8, "actor_util": 0.60, "inference_util": 0.50, "validation_error": 0.15}
CAL = "paper_gpu"
RL_SPECS = {  # the paper's 3 RL tenants: LIBERO (robosuite Lift, LIBERO's engine) + two ManiSkill configs
    "libero-lift": {"env": "robosuite/lift-state", "action_dim": 7},
    "ms-push": {"env": "maniskill/pushcube-state", "action_dim": 4},
    "ms-pick-rgb": {"env": "maniskill/pickcube-rgb", "action_dim": 4},
}
SFT_SPEC = {"dataset": "pickcube-scripted", "env": "maniskill/pickcube-state", "action_dim": 4}
# each RL job sized to take about the same time alone on 1-1-2 (the paper runs them one after another)
RL_UPDATES = {"libero-lift": 5, "ms-push": 24, "ms-pick-rgb": 20}
SHARED_POLICIES = ["fifo", "priority", "grouped", "critical", "balanced", "adaptive", "elastic"]
# results.json sections that ran the paper's workload on 2-2-4 against its isolated 1-1-2 (the headline's
# candidates; "paper_collectors1" is another workload): simulator devices running 1 producer, or 2 at once, or
# several with the actor lending its idle devices to the simulators, or the actor and the engines
HEADLINE = ("paper", "paper_shared_sims", "paper_lend", "paper_lend_all")


def rl_job(updates: int, episodes: int = 16, collectors: int = 2) -> dict[str, Any]:
    return {"kind": "rl", "updates": updates, "episodes_per_batch": episodes, "collectors": collectors,
            "ppo": {"update_epochs": 4, "minibatch_size": 256}}


def paper_workload(sft_steps: int = 20, collectors: int = 2) -> Workload:
    jobs = [Job(n, {**s, "hidden_dim": 64, "priority": 1}, rl_job(RL_UPDATES[n], collectors=collectors))
            for n, s in RL_SPECS.items()]
    jobs.append(Job("sft", {**SFT_SPEC, "hidden_dim": 64, "priority": 0},
                    {"kind": "sft", "steps": sft_steps, "batch_size": 256}))
    return Workload("paper", jobs, datapath={"envs_per_producer": 8})


def summarize(run: dict[str, Any]) -> str:
    u = run["utilization"]
    return (f"{run['policy']:9s} makespan {run['makespan_s']:7.1f} s  device {run['device_s']:8.1f} s  util actor "
            f"{u['actor']:.3f} inference {u['inference']:.3f} simulator {u['simulator']:.3f}  groups "
            f"{run['mean_group_rows']:.1f} rows, {100 * run['cross_tenant_share']:.0f} % mixed  action p99 "
            f"{1000 * run['action_wait_all_s']['p99']:.1f} ms  load {os.getloadavg()[0]:.1f}")


def device_settings(emulation: dict[str, Any] | None) -> dict[str, Any]:
    """The devices' settings a run reports (``EmulationSettings``' defaults where ``emulation`` leaves them)."""
    return {f: (emulation or {}).get(f, EmulationSettings.model_fields[f].default)
            for f in ("sim_placement", "lend_actor", "lend_inference")}


def run_layout(workload: Workload, devices: str, k: float, policies: list[dict[str, Any]],
               actor_group: int = 0, rounds: int = 1, producers_per_sim: int = 1,
               boot: str | None = None, emulation: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Each policy ``rounds`` times on one service (policies in turn, so host noise spreads over all); per
    policy the run of median device time, with every round's device time kept. The service boots with the
    catalog policy ``boot`` (default: the first policy's name); ``emulation``: more of the devices' settings
    (``EmulationSettings``: ``sim_placement``, ``lend_actor``, ``lend_inference``)."""
    svc = EmulatedService(workload, devices, CAL, k, boot or policies[0]["name"], actor_group=actor_group,
                          producers_per_sim=producers_per_sim, emulation=emulation)
    try:
        got: dict[str, list[dict[str, Any]]] = {p["name"]: [] for p in policies}
        for _ in range(rounds):
            for p in policies:
                r = svc.run(p)
                r["k"], r["devices"], r["producers_per_sim"] = k, devices, producers_per_sim
                r.update(device_settings(emulation))
                print(f"  {devices} k={k:g} {summarize(r)}", flush=True)
                got[p["name"]].append(r)
        out = []
        for runs in got.values():
            runs.sort(key=lambda r: r["device_s"])
            med = runs[len(runs) // 2]
            med["rounds_device_s"] = [r["device_s"] for r in runs]
            out.append(med)
        return out
    finally:
        svc.close()


def compare(iso: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    return {"efficiency": iso["device_s"] / shared["device_s"],
            "device_time_saved": 1 - shared["device_s"] / iso["device_s"],
            "actor_util": shared["utilization"]["actor"], "inference_util": shared["utilization"]["inference"],
            "simulator_util": shared["utilization"]["simulator"],
            "simulator_stepping": shared["simulator_split_s"].get("stepping", 0.0)
            / max(shared["slots"]["simulator"] * shared["makespan_s"], 1e-9), "ceiling": ceiling(iso, shared),
            # steps run on lent devices, and the owners' work heard of too late to push them back (free for them)
            **{key: sum(s.get(key, 0.0) for s in shared.get("spans", ())) for key in ("lent_s", "lent_missed_s")}}


def ceiling(iso: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """What no order, split or policy can pass while every device keeps its service: each service's work on its
    own devices, every one busy all the time, bounds the shared makespan below — the simulators' stepping (the
    isolated run's, the same episodes), the actor's and inference's busy time (this run's own: an actor group's
    update keeps all its devices busy); the largest of the three is the bound (``bound_by``: on 2-2-4, the
    simulators). When the actor lends its idle devices to the simulators (``lend_actor``), the stepping and the
    actor's work share both services' devices instead (``bound_by`` ``simulator+actor``; a lent device steps at a
    simulator device's rate); so with the engines' devices (``lend_inference``: ``simulator+inference``, or all
    three). At that makespan: the efficiency, and the actor's and inference's utilizations."""
    stepping = iso.get("simulator_split_s", {}).get("stepping", 0.0)  # older runs did not keep it
    if stepping <= 0:
        return {}
    busy, slots = shared["busy_s"], shared["slots"]
    bounds = {"simulator": stepping / max(slots["simulator"], 1), "actor": busy["actor"] / max(slots["actor"], 1),
              "inference": busy["inference"] / max(slots["inference"], 1)}
    pooled = ["simulator", *(s for s in ("actor", "inference") if shared.get(f"lend_{s}"))]
    if len(pooled) > 1:
        for s in pooled:
            del bounds[s]
        bounds["+".join(pooled)] = (stepping + sum(busy[s] for s in pooled[1:])) / max(sum(slots[s] for s in pooled), 1)
    bound_by = max(bounds, key=bounds.__getitem__)
    makespan = bounds[bound_by]
    return {"makespan_s": makespan, "bound_by": bound_by, "reached": makespan / shared["makespan_s"],
            "efficiency": iso["device_s"] / (sum(slots.values()) * makespan),
            "actor_util": busy["actor"] / (slots["actor"] * makespan),
            "inference_util": busy["inference"] / (slots["inference"] * makespan)}


def against_ceiling(row: dict[str, Any]) -> str:
    """A ``compare`` row's figures next to their ceilings, and how much of its bound the run reached."""
    c = row["ceiling"]
    return (f"efficiency {row['efficiency']:.3f} (ceiling {c['efficiency']:.3f}), actor {row['actor_util']:.3f} "
            f"({c['actor_util']:.3f}), inference {row['inference_util']:.3f} ({c['inference_util']:.3f}); makespan "
            f"at {100 * c['reached']:.1f} % of its bound (by the {c['bound_by']})")


def paper(args) -> dict[str, Any]:
    wl = paper_workload(args.sft_steps, args.collectors)
    m = args.producers_per_sim
    print(f"paper scale, k={args.k:g}: isolated 1-1-2, then {args.policies} on 2-2-4 ({m} producers per "
          "simulator device)", flush=True)
    elastic = policy("elastic")  # the isolated run with elastic's batch split
    like = {k: knob(elastic, k) for k in ("rollout_split", "rollout_split_rule")}
    iso_m, iso_pol = (m, policy("isolated", **like)) if args.isolated_like_shared else (1, policy("isolated"))
    # the shared server's; the isolated one's too when like the shared
    lend = {"lend_actor": args.lend_actor, "lend_inference": args.lend_inference}
    iso_emu = lend if args.isolated_like_shared else None
    iso = run_layout(wl, "1-1-2", args.k, [iso_pol], rounds=args.rounds, producers_per_sim=iso_m,
                     emulation=iso_emu)[0]
    shared = run_layout(wl, "2-2-4", args.k, [policy(p) for p in args.policies.split(",")], rounds=args.rounds,
                        producers_per_sim=m, emulation=lend)
    table = {r["policy"]: compare(iso, r) for r in shared}
    best = max(table, key=lambda p: table[p]["efficiency"])
    for name, row in table.items():
        print(f"  {name:9s} {against_ceiling(row)}", flush=True)
    sweep: dict[str, Any] = {}
    for k in [float(x) for x in args.ks.split(",") if x]:
        pols = list(dict.fromkeys(["fifo", best]))
        i = iso if k == args.k else run_layout(wl, "1-1-2", k, [iso_pol], rounds=args.sweep_rounds,
                                               producers_per_sim=iso_m, emulation=iso_emu)[0]
        ss = [r for r in shared if r["policy"] in pols] if k == args.k else run_layout(
            wl, "2-2-4", k, [policy(p) for p in pols], rounds=args.sweep_rounds, producers_per_sim=m, emulation=lend)
        sweep[f"{k:g}"] = {r["policy"]: {**compare(i, r), "makespan_s": r["makespan_s"], "iso_makespan_s":
                                         i["makespan_s"]} for r in ss}
    spread = {}
    for p in dict.fromkeys(["fifo", best]):
        for metric in ("efficiency", "actor_util", "inference_util"):
            xs = [v[p][metric] for v in sweep.values() if p in v]
            if xs:
                spread[f"{p}.{metric}"] = (max(xs) - min(xs)) / (sum(xs) / len(xs))
    png = "timeline_paper.png" if args.section in (None, "paper") else f"timeline_{args.section}.png"
    draw_timelines([iso, next(r for r in shared if r["policy"] == best)], HERE / png)
    for r in [iso, *shared]:
        r.pop("spans", None)
    return {"k": args.k, "producers_per_sim": m, "lend_actor": args.lend_actor, "lend_inference": args.lend_inference,
            "isolated_like_shared": args.isolated_like_shared, "isolated": iso,
            "shared": shared, "table": table, "best": best, "k_sweep": sweep, "k_spread": spread, "paper": PAPER}


def large_workload(seed: int, rl_tenants: int = 10, sft_tenants: int = 22, window_s: float = 120.0) -> Workload:
    """10 long RL jobs at the start (the three RL kinds in turn, the paper-scale job sizes), 22 short SFT jobs
    arriving as a Poisson process over ``window_s`` (seconds at k = 1)."""
    rng = random.Random(seed)
    names = list(RL_SPECS)
    jobs = []
    for i in range(rl_tenants):
        base = names[i % len(names)]
        jobs.append(Job(f"rl{i:02d}-{base}", {**RL_SPECS[base], "hidden_dim": 64, "priority": 1},
                        rl_job(RL_UPDATES[base]), arrival_s=0.0))
    t = 0.0
    for i in range(sft_tenants):
        t += rng.expovariate(sft_tenants / window_s)
        jobs.append(Job(f"sft{i:02d}", {**SFT_SPEC, "hidden_dim": 64, "priority": 0},
                        {"kind": "sft", "steps": rng.choice((10, 20, 40)), "batch_size": 256}, arrival_s=t))
    return Workload("large", jobs, datapath={"envs_per_producer": 8})


def _kind(j: Job) -> str:
    return json.dumps([j.spec.get("env"), j.spec.get("dataset"), j.job], sort_keys=True)


def large(args) -> dict[str, Any]:
    wl = large_workload(args.seed)
    k = args.k_large
    for j in wl.jobs:
        j.arrival_s /= k
    concurrent = 8  # 16 actor devices in data-parallel groups of 2: one per server
    pols = [policy(p, max_concurrent_updates=concurrent) for p in args.large_policies.split(",")]
    # the baseline: each distinct job alone on a 1-1-2 server, one after another (the isolated policy)
    distinct: dict[str, Job] = {}
    for j in wl.jobs:
        distinct.setdefault(_kind(j), Job(f"alone{len(distinct)}", j.spec, j.job))
    print(f"64 devices: the {len(distinct)} distinct jobs alone on 1-1-2, k={k:g}", flush=True)
    alone = run_layout(Workload("alone", list(distinct.values()), wl.datapath), "1-1-2", k, [policy("isolated")])[0]
    iso_time = {j.tenant: alone["job_s"][distinct[_kind(j)].tenant] for j in wl.jobs}
    iso_device = 4 * sum(iso_time.values())
    print(f"64 devices (16-16-32), 32 tenants, k={k:g}: {args.large_policies}", flush=True)
    shared = run_layout(wl, "16-16-32", k, pols, actor_group=2, producers_per_sim=args.producers_per_sim)
    out = {}
    for r in shared:
        resp = r["response_s"]
        share = [iso_time[n] / resp[n] for n in resp]
        qd = r["queue_delay_s"]
        rl = [n for n in r["action_wait_s"] if n.startswith("rl")]
        out[r["policy"]] = {
            "device_s": r["device_s"], "isolated_device_s": iso_device, "efficiency": iso_device / r["device_s"],
            "utilization": r["utilization"], "makespan_s": r["makespan_s"],
            "jain_fairness": jain(share), "slowdown_p50": pct([1 / s for s in share], 0.5),
            "slowdown_max": max(1 / s for s in share),
            "training_queue_delay_s": {"p50_of_tenant_p50": pct([v["p50"] for v in qd.values()], 0.5),
                                       "p99_worst_tenant": max((v["p99"] for v in qd.values()), default=0.0),
                                       "per_tenant": qd},
            "action_wait_s": {**r["action_wait_all_s"], "per_tenant": r["action_wait_s"],
                              "p99_worst_tenant": max((r["action_wait_s"][n]["p99"] for n in rl), default=0.0)},
            "mean_group_rows": r["mean_group_rows"], "cross_tenant_share": r["cross_tenant_share"],
            "busy_le_wall": r["busy_le_wall"], "completion_s": r["completion_s"], "response_s": resp}
        o = out[r["policy"]]
        print(f"  {r['policy']:9s} efficiency {o['efficiency']:.2f}  Jain {o['jain_fairness']:.3f}  queue p50 "
              f"{o['training_queue_delay_s']['p50_of_tenant_p50']:.3f} s  action p99 "
              f"{1000 * r['action_wait_all_s']['p99']:.1f} ms", flush=True)
    return {"k": k, "producers_per_sim": args.producers_per_sim, "workload": [vars(j) for j in wl.jobs],
            "isolated_job_s": iso_time, "policies": out,
            "alone_run": {k2: alone[k2] for k2 in ("makespan_s", "job_s", "utilization")}}


def draw_timelines(runs: list[dict[str, Any]], path: Path) -> None:
    """Who used which device when: the isolated run and the best shared run (black: a mixed forward)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tenants = sorted({t for r in runs for s in r["spans"] for t in s["tenant"].split("+")})
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(tenants)}
    span = max(r["makespan_s"] for r in runs)
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2 + 0.45 * sum(len({s["worker"] for s in r["spans"]})
                                                                        for r in runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        rows = sorted({(s["service"], s["worker"]) for s in run["spans"]},
                      key=lambda sw: (("actor", "inference", "simulator").index(sw[0]), sw[1]))
        for y, (service, worker) in enumerate(rows):
            bars: dict[Any, list] = {}
            for s in run["spans"]:
                if (s["service"], s["worker"]) == (service, worker):
                    a, b = max(s["t0"], run["t0"]) - run["t0"], min(s["t1"], run["t1"]) - run["t0"]
                    ts = s["tenant"].split("+")
                    bars.setdefault(colors.get(ts[0], "gray") if len(ts) == 1 else "black", []).append(
                        (a, max(b - a, 0.002)))
            for c, bs in bars.items():
                ax.broken_barh(bs, (y - 0.4, 0.8), facecolors=c, linewidth=0)
        ax.set_yticks(range(len(rows)), [f"{s} {w}" for s, w in rows], fontsize=7)
        ax.set_xlim(0, span * 1.02)
        u = run["utilization"]
        ax.set_title(f"{run['devices']} {run['policy']} (k={run['k']:g}): makespan {run['makespan_s']:.1f} s, "
                     f"utilization actor {100 * u['actor']:.0f} %, inference {100 * u['inference']:.0f} %, "
                     f"simulator {100 * u['simulator']:.0f} %", fontsize=9)
    axes[-1, 0].set_xlabel("seconds since submission (emulated time / k)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend([*handles, plt.Rectangle((0, 0), 1, 1, color="black")], [*colors, "mixed forward"],
               loc="upper right", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100)


def main() -> None:
    if sys.argv[1:2] in (["validate"], ["calibrate"]):  # the other subcommands live in helper modules
        import importlib

        helper = importlib.import_module(sys.argv[1])
        sys.argv = [str(HERE / f"{sys.argv[1]}.py"), *sys.argv[2:]]
        helper.main()
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("paper", "large"), help="also: validate, calibrate (each with its own --help)")
    ap.add_argument("--k", type=float, default=10.0, help="time scale of the main paper-scale runs")
    ap.add_argument("--ks", default="5,10,20", help="time scales of the sweep (isolated, fifo and the best policy)")
    ap.add_argument("--k-large", type=float, default=2.0, help="time scale of the 64-device runs")
    ap.add_argument("--large-policies", default="fifo,grouped,critical,adaptive")
    ap.add_argument("--policies", default=",".join(SHARED_POLICIES))
    ap.add_argument("--sft-steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="runs per policy at the main k (median device time)")
    ap.add_argument("--sweep-rounds", type=int, default=1, help="runs per policy at each other k of the sweep (the "
                    "same rule: the median, the slower of two)")
    ap.add_argument("--collectors", type=int, default=2, help="producers per RL job (paper: 2, one per simulator "
                    "device of the isolated server)")
    ap.add_argument("--producers-per-sim", type=int, default=1, help="producers a simulator device of the shared "
                    "server (2-2-4, or 16-16-32 for 'large') runs at once, their steps taking turns (the isolated "
                    "baseline keeps 1: the paper's)")
    ap.add_argument("--isolated-like-shared", action="store_true", help="the isolated baseline with the shared "
                    "server's producers per simulator device and RL batches split over free simulators (elastic's "
                    "rollout_split): what those two give a tenant alone")
    ap.add_argument("--lend-actor", action="store_true", help="the shared server's actor lends its idle devices to "
                    "the simulators (EmulationSettings.lend_actor; the isolated baseline keeps the paper's fixed "
                    "roles unless --isolated-like-shared)")
    ap.add_argument("--lend-inference", action="store_true", help="the shared server's engines lend their devices to "
                    "the simulators, running their forwards there first (EmulationSettings.lend_inference; the "
                    "isolated baseline as for --lend-actor)")
    ap.add_argument("--section", default=None, help="the results.json section (default: paper | large); the "
                    "headline figures come from the best of HEADLINE's sections")
    ap.add_argument("--out", default=str(HERE / "results.json"))
    args = ap.parse_args()
    t0 = time.time()
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {}
    section = paper(args) if args.what == "paper" else large(args)
    name = args.section or args.what
    if args.what == "paper" and not section["k_sweep"] and name in doc:  # --ks "": keep the last sweep
        for key in ("k_sweep", "k_spread"):
            section[key] = doc[name].get(key)
        section["k_sweep_from"] = doc[name].get("meta", {}).get("command")
    section["meta"] = {"command": "python experiments/paper_scale/bench.py " + " ".join(sys.argv[1:]),
                       "cpu_count": os.cpu_count(), "load_avg_end": os.getloadavg(), "bench_s": time.time() - t0,
                       "calibration": CAL}
    doc[name] = section
    runs = [(sec, doc[sec]["best"]) for sec in HEADLINE if sec in doc]
    if runs:  # the headline figures: paper scale (the paper's workload), best policy, fractions
        sec, pol = max(runs, key=lambda r: doc[r[0]]["table"][r[1]]["efficiency"])
        best = doc[sec]["table"][pol]
        doc.update({"efficiency": best["efficiency"], "actor_util": best["actor_util"],
                    "inference_util": best["inference_util"], "best_policy": pol, "best_section": sec,
                    "best_producers_per_sim": doc[sec].get("producers_per_sim", 1),
                    "best_lend_actor": bool(doc[sec].get("lend_actor")),
                    "best_lend_inference": bool(doc[sec].get("lend_inference")),
                    "ceiling": best.get("ceiling") or ceiling(doc[sec]["isolated"], next(
                        r for r in doc[sec]["shared"] if r["policy"] == pol))})
    if "paper_iso_like_shared" in doc:  # the same against an isolated server that shares its simulators too
        like = doc["paper_iso_like_shared"]
        doc["efficiency_vs_isolated_like_shared"] = like["table"][like["best"]]["efficiency"]
    doc.setdefault("targets", TARGETS)
    out.write_text(json.dumps(doc, indent=1, default=float))
    print(f"wrote {out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
