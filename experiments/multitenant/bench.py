"""Multi-tenant vs the isolated baseline on one service: 3 RL tenants + 1 SFT tenant, real compute.

The workload of the paper's sharing experiment at small scale: RL on ManiSkill state
(``maniskill/pushcube-state``), ManiSkill rgb (``maniskill/pickcube-rgb``, 64 px camera) and robosuite
Lift (``robosuite/lift-state``, standing in for LIBERO: same engine and Panda schema), and SFT on the
scripted PickCube demonstrations (``pickcube-scripted``), each job sized to take about the same time
alone (``--mix equal-time``, the default; ``equal-updates``: the same updates for every RL job). One
``Nexus.local`` service (scheduler, 2 SIM workers, 1 actor rank, 1 inference engine); every round runs
the same work in each mode:

- isolated: the ``isolated`` policy (``schedulers/isolated.toml``): the four jobs are submitted at once
  and the service's admission runs them one tenant after another (FIFO by submission), through the
  same flows, queues and services;
- multi-<policy>: the shared policies (default ``priority``, ``grouped`` and ``gather`` from
  ``schedulers/``): the four jobs at once, sharing the actor, the engine (cross-tenant groups) and the
  simulators.

The scheduler is switched between runs on the idle service (``nexus_set_scheduler``), the order of the modes
rotates from round to round, and one warm-up run is not counted. Accounting comes from the services' own
records (``nexus_accounting``: spans per slot): device time = allocated slots x wall time, utilization =
busy / allocated, the simulator's busy time split into stepping vs waiting for actions. Efficiency =
isolated / multi device time (= makespan ratio: both modes hold the same slots the whole time); also
against an isolated baseline charged only the slots each job used (``partition_device_s``). Before the
rounds every RL tenant's envs are built on every SIM worker (``nexus.sim.tasks.prewarm``), so no measured run
pays env construction; each run also records the CPU time of every process of the service, by role
(``LocalService.cpu_seconds``): on a machine of few cores the shared runs are CPU-bound.

    python experiments/multitenant/bench.py                  # CPU, ~9 min on 2 cores
    python experiments/multitenant/bench.py --device cuda    # GPU (bf16 backbone), not run here
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
PAPER = {"efficiency": 1.39, "utilization": {"actor": (0.208, 0.413), "inference": (0.281, 0.375)}}
SERVICES, SPLIT = ("actor", "inference", "simulator"), ("sim_s", "action_wait_s")
WORKER_NAMES: dict[str, str] = {}  # worker address -> name (timeline labels)
WORKLOAD = {  # name -> (spec fields, job): the paper's 3 RL + 1 SFT mix
    "ms-state": ({"env": "maniskill/pushcube-state", "action_dim": 4, "priority": 1}, "rl"),
    "ms-rgb": ({"env": "maniskill/pickcube-rgb", "action_dim": 4, "priority": 1}, "rl"),
    "rs-lift": ({"env": "robosuite/lift-state", "action_dim": 7, "priority": 1}, "rl"),
    "sft": ({"dataset": "pickcube-scripted", "env": "maniskill/pickcube-state", "action_dim": 4, "lr": 1e-3}, "sft"),
}
TENANTS: dict[str, tuple[dict, str]] = dict(WORKLOAD)  # the run's tenants (--tenants 8: the mix twice)
BASE: dict[str, str] = {n: n for n in WORKLOAD}  # tenant -> its name in WORKLOAD (copies: "<name>-<i>")
# Job sizes per tenant (overrides of --updates / --sft-steps). "equal-time" follows the paper's baseline
# ("... then an equal amount of SFT work"): each job takes about the same time alone, ~25 s on these CPUs,
# sized from the isolated job times in results_cpu_equal-updates.json (a PPO update of 4
# episodes: ms-state 3.1 s, ms-rgb 24.5 s, rs-lift 9.1 s; an SFT step of 32 samples 0.08 s).
# "equal-updates": every RL job the same updates (ms-rgb's ~8x slower steps then dominate the makespan).
MIXES: dict[str, dict[str, dict]] = {
    "equal-time": {"ms-state": {"updates": 8}, "ms-rgb": {"updates": 1}, "rs-lift": {"updates": 3},
                   "sft": {"steps": 300}},
    "equal-updates": {},
}


def scale_workload(n: int) -> dict[str, tuple[dict, str]]:
    """``n`` tenants (a multiple of 4): the mix repeated, copies named ``<name>-<i>``."""
    if n < 4 or n % 4:
        raise SystemExit(f"--tenants must be a multiple of 4 (the 3 RL + 1 SFT mix), got {n}")
    BASE.clear()
    BASE.update({(name if i == 0 else f"{name}-{i}"): name for i in range(n // 4) for name in WORKLOAD})
    return {copy: WORKLOAD[name] for copy, name in BASE.items()}


def _jobs(args, warm: bool = False) -> dict[str, dict]:
    rl = {"kind": "rl", "updates": args.updates, "episodes_per_batch": args.episodes,
          "collectors": args.collectors, "ppo": {"update_epochs": 2, "minibatch_size": 64}}
    sft = {"kind": "sft", "steps": args.sft_steps, "batch_size": 32}
    jobs = {}
    for n, (_, kind) in TENANTS.items():
        size = ({"updates": 1} if kind == "rl" else {"steps": 3}) if warm else MIXES[args.mix].get(BASE[n], {})
        jobs[n] = {**(rl if kind == "rl" else sft), **size}
    return jobs


def warm_up(nx, policy: dict, args) -> dict[str, dict[str, int]]:
    """Build every RL tenant's envs on every SIM worker (``sim_tasks.prewarm``: ms-rgb's first rgb envs on a
    worker cost ~13 s), so that no measured run pays env construction wherever its rollouts land; then
    one short run of every job. Returns SIM worker -> env -> env groups idle in its pool."""
    from nexus.control.tasks import PREWARM

    envs = sorted({kw["env"] for kw, kind in TENANTS.values() if kind == "rl"})
    sims = [a for a, info in nx.service.client.scheduler_info()["workers"].items() if "SIM" in info["resources"]]
    futs = {(WORKER_NAMES[w], e): nx.service.client.submit(PREWARM, e, args.envs, workers=[w], resources={"SIM": 1},
                                                   pure=False) for w in sims for e in envs}
    idle: dict[str, dict[str, int]] = {}
    for (w, e), f in futs.items():
        idle.setdefault(w, {})[e] = f.result()
    run_mode(nx, "warm-up", policy, args, warm=True)
    return idle


def cpu_seconds(nx) -> dict[str, float]:
    """CPU time of the service's processes by name (``LocalService.cpu_seconds``) and of this client."""
    t = os.times()
    return {**nx.service.cpu_seconds(), "client": t.user + t.system}


def run_mode(nx, mode: str, policy: dict, args, warm: bool = False) -> dict:
    """Submit the four jobs at once under ``policy``; the run's timing, accounting and groups."""
    nx.service.internal("nexus_set_scheduler", scheduler=policy)
    engine = nx.service.engine()
    engine.reset_stats().result()
    before = nx.monitoring(since=time.time())
    cpu0 = cpu_seconds(nx)
    t0 = time.time()
    handles = {n: nx.tenant(n).submit(job) for n, job in _jobs(args, warm).items()}
    results = {n: h.result(timeout=3600) for n, h in handles.items()}
    t1 = time.time()
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu_seconds(nx).items()}
    nx.flush()
    views = {n: h.info() for n, h in handles.items()}
    for n, v in views.items():
        if v["state"] != "done":
            raise RuntimeError(f"{mode}: job of {n} ended {v['state']}: {v['error']}")
    acc = nx.service.internal("nexus_accounting", t0=t0, t1=t1)
    mon = nx.monitoring(since=t0)
    stats = engine.engine_stats().result()
    sizes = {int(k): v for k, v in stats["size_hist"].items()}
    calls = {int(k): v for k, v in stats["calls_hist"].items()}
    tenants_hist = {int(k): v for k, v in stats["tenants_hist"].items()}

    def delta(key: str, tenant: str, field: str) -> float:
        return mon[key].get(tenant, {}).get(field, 0.0) - before[key].get(tenant, {}).get(field, 0.0)

    sfts = [n for n, (_, kind) in TENANTS.items() if kind == "sft"]
    sft_actor = sum(delta("metering", n, "actor") for n in sfts)
    sft_sync = sum(delta("weight_sync", n, "seconds") for n in sfts)
    groups = max(sum(sizes.values()), 1)
    spans = [s for s in mon["spans"] if s["t1"] >= t0 and s["t0"] <= t1]
    job_s = {n: v["t_end"] - v["t_start"] for n, v in views.items()}
    return {
        "mode": mode, "policy": policy["name"], "t0": t0, "t1": t1, "makespan_s": t1 - t0,
        "device_s": acc["device_s"], "accounting": acc,
        "utilization": {s: r["utilization"] for s, r in acc["services"].items()},
        "simulator_split_s": acc["services"]["simulator"]["split_s"],
        "completion_s": {n: v["t_end"] - t0 for n, v in views.items()},
        "job_s": job_s, "partition_device_s": partition_device_s(spans, job_s),
        "queued_s": {n: v["t_start"] - v["t_submit"] for n, v in views.items()},
        "env_steps": {n: r.get("env_steps", 0) for n, r in results.items()},
        "groups": sum(sizes.values()), "mean_group_rows": sum(k * v for k, v in sizes.items()) / groups,
        "mean_group_requests": sum(k * v for k, v in calls.items()) / max(sum(calls.values()), 1),
        "cross_tenant_share": sum(v for k, v in tenants_hist.items() if k > 1) / groups,
        "group_rows_hist": sizes, "group_requests_hist": calls, "group_tenants_hist": tenants_hist,
        "fire_reasons": stats["reasons"],
        # CPU: on a machine of few cores the shared run is CPU-bound; cores_busy = CPU-s / wall
        "cpu_s": cpu, "cpu_total_s": sum(cpu.values()), "cores_busy": sum(cpu.values()) / (t1 - t0),
        "sft_actor_s": sft_actor, "sft_sync_s": sft_sync,
        # per tenant, the services' own accounting of this run: what experiments/paper_scale calibrates from
        "service_times": {n: {"metering_s": {s: delta("metering", n, s) for s in SERVICES},
                              "simulator_split_s": {k: delta("simulator_split", n, k) for k in SPLIT},
                              "result": {k: v for k, v in results[n].items() if isinstance(v, int | float)}}
                          for n in TENANTS},
        "engine_busy_s": stats["busy_s"],
        "sft_sync_share": sft_sync / sft_actor if sft_actor > 0 else 0.0,
        "spans": spans,
    }


def partition_device_s(spans: list[dict], job_s: dict[str, float]) -> float:
    """Device time if each tenant's job had held only the slots it used (one SIM worker for one
    producer, no engine for an SFT job): sum over tenants of its slots x its job's wall time. The
    isolated baseline on a right-sized partition; the run's own charge holds every slot."""
    used: dict[str, set] = {n: set() for n in job_s}
    for s in spans:
        for t in s["tenant"].split("+"):
            if t in used:
                used[t].add((s["service"], s["worker"]))
    return sum(len(used[n]) * job_s[n] for n in job_s)


def draw_timelines(runs: list[dict], path: Path) -> None:
    """Who used which service slot when, one panel per mode (the same round)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(TENANTS)}
    span = max(r["makespan_s"] for r in runs)
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2.2 + 1.1 * len(runs) * 2), squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        rows = sorted({(s["service"], s["worker"]) for s in run["spans"]},
                      key=lambda sw: (("actor", "inference", "simulator").index(sw[0]), sw[1]))
        for y, (service, worker) in enumerate(rows):
            for s in run["spans"]:
                if (s["service"], s["worker"]) != (service, worker):
                    continue
                a, b = max(s["t0"], run["t0"]) - run["t0"], min(s["t1"], run["t1"]) - run["t0"]
                tenants = s["tenant"].split("+")
                c = colors.get(tenants[0], "gray") if len(tenants) == 1 else "black"
                ax.broken_barh([(a, max(b - a, 0.002))], (y - 0.4, 0.8), facecolors=c, linewidth=0)
        ax.set_yticks(range(len(rows)), [f"{s} {WORKER_NAMES.get(w, w)}" for s, w in rows])
        ax.set_xlim(0, span * 1.02)
        u = run["utilization"]
        ax.set_title(f"{run['mode']} ({run['policy']}): makespan {run['makespan_s']:.0f} s, utilization actor "
                     f"{100 * u['actor']:.0f} %, inference {100 * u['inference']:.0f} %, simulator "
                     f"{100 * u['simulator']:.0f} %", fontsize=9)
    axes[-1, 0].set_xlabel("seconds since the run's submission")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()] + [
        plt.Rectangle((0, 0), 1, 1, color="black")]
    fig.legend(handles, [*colors, "mixed group"], loc="upper right", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--pairs", type=int, default=3, help="measured rounds (each: isolated + every shared policy)")
    ap.add_argument("--policies", default="priority,grouped,gather", help="shared policies compared against isolated")
    ap.add_argument("--updates", type=int, default=2, help="PPO updates per RL job")
    ap.add_argument("--episodes", type=int, default=4, help="episodes per RL batch")
    ap.add_argument("--collectors", type=int, default=1, help="rollout tasks in flight per RL job")
    ap.add_argument("--envs", type=int, default=4, help="K: envs per producer")
    ap.add_argument("--sft-steps", type=int, default=40)
    ap.add_argument("--mix", choices=tuple(MIXES), default="equal-time",
                    help="job sizes per tenant (equal-time: each job about as long alone; equal-updates: "
                         "--updates / --sft-steps for every tenant)")
    ap.add_argument("--n-sim", type=int, default=2, help="SIM workers (one producer each at a time)")
    ap.add_argument("--tenants", type=int, default=4, help="tenants: the 3 RL + 1 SFT mix, repeated (4, 8, ...)")
    ap.add_argument("--out", default=None, help="JSON path (default: results_<device>[_<N>t].json here)")
    args = ap.parse_args()
    TENANTS.clear()
    TENANTS.update(scale_workload(args.tenants))

    from nexus.client.api import Nexus
    from nexus.config.service import Scheduler
    from nexus.spec import TenantSpec

    policies = {n: Scheduler.load(n).model_dump() for n in ["isolated", *args.policies.split(",")]}
    backbone = {"device": args.device, "dtype": "bfloat16" if args.device == "cuda" else "float32"}
    work = Path(tempfile.mkdtemp(prefix="nexus-multitenant-"))
    sizes = ", ".join(f"{n} {j.get('updates', j.get('steps'))}" for n, j in _jobs(args).items())
    print(f"{len(TENANTS)} tenants, {args.n_sim} SIM workers, K={args.envs}; mix {args.mix}: {sizes} "
          f"(RL updates of {args.episodes} episodes, SFT steps); {args.pairs} rounds of isolated + "
          f"{args.policies}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    rounds: list[dict[str, dict]] = []
    t_bench = time.time()
    with Nexus.local(work / "service", n_sim=args.n_sim, backbone=backbone, scheduler=args.policies.split(",")[0],
                     datapath={"envs_per_producer": args.envs}) as nx:
        workers = nx.service.client.scheduler_info()["workers"]
        WORKER_NAMES.update({a: str(i.get("name", a)) for a, i in workers.items()})
        for name, (kw, _) in TENANTS.items():
            nx.create_tenant(TenantSpec(name=name, hidden_dim=128, seed=len(name), **kw))
        idle = warm_up(nx, policies[args.policies.split(",")[0]], args)
        print(f"service up, warm-up done in {time.time() - t_bench:.0f} s; env groups built per SIM worker: {idle}",
              flush=True)
        modes = list(policies)
        for r in range(args.pairs):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            got = {}
            for m in order:
                got[m] = run_mode(nx, "isolated" if m == "isolated" else "multi", policies[m], args)
                print(f"round {r} {m:9s} makespan {got[m]['makespan_s']:6.1f} s  util actor "
                      f"{got[m]['utilization']['actor']:.2f} inference {got[m]['utilization']['inference']:.2f} "
                      f"simulator {got[m]['utilization']['simulator']:.2f}  groups {got[m]['groups']} mean rows "
                      f"{got[m]['mean_group_rows']:.2f}  CPU {got[m]['cpu_total_s']:.0f} s "
                      f"({got[m]['cores_busy']:.2f} cores)  load {os.getloadavg()[0]:.1f}", flush=True)
            rounds.append(got)
    shared = [m for m in policies if m != "isolated"]
    eff = {m: [rd["isolated"]["device_s"] / rd[m]["device_s"] for rd in rounds] for m in shared}
    eff_used = {m: [rd["isolated"]["partition_device_s"] / rd[m]["device_s"] for rd in rounds] for m in shared}
    winner = max(shared, key=lambda m: statistics.median(eff[m]))

    def med(m: str, f) -> float:
        return statistics.median(f(rd[m]) for rd in rounds)

    print(f"\nmedian over {len(rounds)} rounds ({args.device}, {os.cpu_count()} cores; load average at the end "
          f"{os.getloadavg()[0]:.1f}, this benchmark's own processes included)")
    head = f"{'':34s}{'isolated':>12s}" + "".join(f"{'multi ' + m:>16s}" for m in shared) + f"{'paper':>18s}"
    print(head)

    def line(label: str, f, fmt: str, paper: str = "") -> None:
        print(f"{label:34s}{format(med('isolated', f), fmt):>12s}"
              + "".join(f"{format(med(m, f), fmt):>16s}" for m in shared) + f"{paper:>18s}")

    line("makespan, s", lambda x: x["makespan_s"], ".1f")
    line("device time (slots x wall), s", lambda x: x["device_s"], ".1f")
    print(f"{'efficiency isolated / multi':34s}{'':>12s}" + "".join(
        f"{statistics.median(eff[m]):>10.2f}x{'':5s}" for m in shared) + f"{'1.39x':>18s}")
    print(f"{'  range over rounds':34s}{'':>12s}" + "".join(
        f"{min(eff[m]):>7.2f}-{max(eff[m]):.2f}{'':4s}" for m in shared))
    used = med("isolated", lambda x: x["partition_device_s"])
    print(f"{'isolated on used slots only, s':34s}{used:>12.1f}")
    print(f"{'efficiency vs that partition':34s}{'':>12s}" + "".join(
        f"{statistics.median(eff_used[m]):>10.2f}x{'':5s}" for m in shared))
    for s in ("actor", "inference", "simulator"):
        p = PAPER["utilization"].get(s)
        line(f"utilization {s}, %", lambda x, s=s: 100 * x["utilization"][s], ".1f",
             f"{100 * p[0]:.1f} -> {100 * p[1]:.1f}" if p else "-")
    line("  simulator stepping, s", lambda x: x["simulator_split_s"]["stepping"], ".1f")
    line("  simulator waiting for actions, s", lambda x: x["simulator_split_s"]["waiting_for_actions"], ".1f")
    for n in TENANTS:
        line(f"completion {n}, s", lambda x, n=n: x["completion_s"][n], ".1f")
    line("CPU time, all processes, s", lambda x: x["cpu_total_s"], ".1f")
    for label, roles in (("actor", "actor"), ("inference", "infer"), ("simulators", "sim")):
        line(f"  CPU {label}, s", lambda x, r=roles: sum(v for k, v in x["cpu_s"].items() if k.startswith(r)), ".1f")
    line("  CPU scheduler + nannies + client, s", lambda x: sum(
        x["cpu_s"].get(k, 0.0) for k in ("scheduler", "nannies", "client", "gateway")), ".1f")
    line(f"cores busy (of {os.cpu_count()})", lambda x: x["cores_busy"], ".2f")
    ceiling = os.cpu_count() / med("isolated", lambda x: x["cores_busy"])
    print(f"{'ceiling: cores / isolated busy':34s}{ceiling:>11.2f}x   (efficiency if sharing cost no extra CPU "
          "and kept every core busy)")
    line("mean inference group, rows", lambda x: x["mean_group_rows"], ".2f", ">= 4 (target)")
    line("mean inference group, requests", lambda x: x["mean_group_requests"], ".2f")
    line("groups mixing tenants, %", lambda x: 100 * x["cross_tenant_share"], ".1f")
    line("weight sync / SFT actor time, %", lambda x: 100 * x["sft_sync_share"], ".1f", "<= 10 (target)")
    print(f"best shared policy (median efficiency): {winner}")

    # timelines of one round: the one whose efficiency (winner) is the median
    order_idx = sorted(range(len(rounds)), key=lambda i: eff[winner][i])[len(rounds) // 2]
    suffix = args.device + ("" if args.tenants == 4 else f"_{args.tenants}t") + (
        "" if args.mix == "equal-time" else f"_{args.mix}")
    out = Path(args.out) if args.out else HERE / f"results_{suffix}.json"
    # the picture goes beside its JSON: a run with --out elsewhere leaves the committed picture alone
    png = out.with_name(f"timeline_{suffix}.png" if not args.out else f"{out.stem}_timeline.png")
    draw_timelines([rounds[order_idx]["isolated"], rounds[order_idx][winner]], png)
    summary = {"efficiency": {m: {"median": statistics.median(eff[m]), "min": min(eff[m]), "max": max(eff[m]),
                                  "rounds": eff[m]} for m in shared},
               "efficiency_vs_used_slots": {m: {"median": statistics.median(eff_used[m]), "rounds": eff_used[m]}
                                            for m in shared}, "winner": winner,
               "median": {m: {"makespan_s": med(m, lambda x: x["makespan_s"]),
                              "device_s": med(m, lambda x: x["device_s"]),
                              "partition_device_s": med(m, lambda x: x["partition_device_s"]),
                              "utilization": {s: med(m, lambda x, s=s: x["utilization"][s])
                                              for s in ("actor", "inference", "simulator")},
                              "completion_s": {n: med(m, lambda x, n=n: x["completion_s"][n]) for n in TENANTS},
                              "mean_group_rows": med(m, lambda x: x["mean_group_rows"]),
                              "mean_group_requests": med(m, lambda x: x["mean_group_requests"]),
                              "cross_tenant_share": med(m, lambda x: x["cross_tenant_share"]),
                              "sft_sync_share": med(m, lambda x: x["sft_sync_share"]),
                              "cpu_total_s": med(m, lambda x: x["cpu_total_s"]),
                              "cores_busy": med(m, lambda x: x["cores_busy"])} for m in policies},
               "cpu_ceiling": ceiling,
               "paper": PAPER, "timeline_round": order_idx}
    for rd in rounds:  # the spans stay out of the JSON (the PNG shows one round's)
        for run in rd.values():
            run.pop("spans")
    out.write_text(json.dumps({
        "meta": {**vars(args), "tenant_specs": TENANTS, "jobs": _jobs(args), "policies": policies,
                 "cpu_count": os.cpu_count(), "python": platform.python_version(), "load_avg_end": os.getloadavg(),
                 "bench_s": time.time() - t_bench,
                 "command": "python experiments/multitenant/bench.py " + " ".join(sys.argv[1:])},
        "summary": summary, "rounds": rounds}, indent=1, default=float))
    print(f"wrote {out} and {png} ({time.time() - t_bench:.0f} s)")


if __name__ == "__main__":
    main()
