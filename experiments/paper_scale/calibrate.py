"""Write ``calibrations/cpu_multitenant.toml`` from the real CPU run, measured by the service's own accounting.

Source: ``experiments/multitenant/results_cpu_calibration.json`` (``python experiments/multitenant/bench.py
--pairs 2 --policies priority --out experiments/multitenant/results_cpu_calibration.json``): per tenant, the
metered actor, inference and simulator seconds and the simulator's stepping time of each *isolated* run
(each job alone), with its job result (updates or steps, episodes, env steps, action requests). Per tenant:

* env step (one lockstep step of its K envs, one request each) = stepping seconds / requests;
* forward of its K rows = its metered inference seconds / requests, split into a fixed and a per-row part
  with the ratio ``experiments/group_batching/results_cpu.json`` measures for its head family (grouped
  forwards of 1..64 samples on this CPU, least squares);
* RL update = metered actor seconds / updates, fitted over the RL tenants as call + row x rows x epochs;
  SFT step = metered actor seconds / steps.

Medians over the isolated rounds. With ``--host`` (``device_work = "host_cpu"``, :mod:`nexus.emulator.host`), also
the ``[host]`` CPU the real processes spend per unit of work besides their device work — per role, the isolated
rounds' process CPU time less its metered device time (the engine's per action request, the simulators' per request,
the actor's per training item) — less what the emulated processes spend themselves for the same work, measured in an
isolated emulated run of the same workload (device work that sleeps, so their CPU is their own): the host work the
emulator does not do already. Isolated runs only, real and emulated.

    python experiments/paper_scale/calibrate.py           # device times only
    python experiments/paper_scale/calibrate.py --host    # ... and [host] (one emulated isolated run, ~1 min)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "experiments/multitenant/results_cpu_calibration.json"
GROUPING = ROOT / "experiments/group_batching/results_cpu.json"
OUT = ROOT / "calibrations/cpu_multitenant.toml"


def call_row_ratio(family: str) -> float:
    """Fixed cost / per-row cost of one grouped forward on this CPU (least squares over samples)."""
    pts = [(r["samples"], r["forward_grouped_s"]) for r in json.loads(GROUPING.read_text())["results"]
           if r["family"] == family]
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    a = my - b * mx
    return max(a, 0.0) / b


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    if len(xs) < 2 or max(xs) == min(xs):
        return statistics.mean(ys), 0.0
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    if b < 0:
        return my, 0.0
    return my - b * mx, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", action="store_true", help="also the [host] CPU per unit of work (an emulated run)")
    args = ap.parse_args()
    doc = json.loads(SOURCE.read_text())
    write(doc, "isolated", OUT, "the isolated runs'")  # the device times the emulated run below takes
    if args.host:
        write(doc, "isolated", OUT, "the isolated runs'", host_costs(doc))


def units(res: dict) -> dict[str, float]:
    """Per role, the units its host work is counted in: action requests (engine, simulators), training items."""
    requests = sum(r.get("requests", 0) for r in res.values())
    return {"infer": requests, "sim": requests,
            "actor": sum(r.get("updates", 0) + r.get("steps", 0) for r in res.values())}


def role_cpu(cpu: dict[str, float]) -> dict[str, float]:
    return {role: sum(v for k, v in cpu.items() if k.startswith(role)) for role in ("infer", "sim", "actor")}


def host_costs(doc: dict) -> dict[str, float]:
    """The [host] section: real non-device CPU per unit (isolated rounds) less the emulated processes' own."""
    real: dict[str, list[float]] = {"infer": [], "sim": [], "actor": []}
    n = {role: statistics.median(units({t: s["result"] for t, s in rd["isolated"]["service_times"].items()})[role]
                                 for rd in doc["rounds"]) for role in real}
    for rd in doc["rounds"]:
        run = rd["isolated"]
        st = run["service_times"]
        cpu = role_cpu(run["cpu_s"])
        device = {"infer": sum(s["metering_s"]["inference"] for s in st.values()),
                  "sim": run["simulator_split_s"]["stepping"],
                  "actor": sum(s["metering_s"]["actor"] for s in st.values())}
        for role in real:
            real[role].append(max(0.0, cpu[role] - device[role]) / max(n[role], 1))
    own = {role: cpu / max(n[role], 1) for role, cpu in emulated_own_cpu(doc).items()}
    host = {role: max(0.0, statistics.median(real[role]) - own[role]) for role in real}
    for role in real:
        print(f"host CPU per unit, {role}: real {1000 * statistics.median(real[role]):.2f} ms less the emulated "
              f"processes' own {1000 * own[role]:.2f} ms -> {1000 * host[role]:.2f} ms")
    return host


def emulated_own_cpu(doc: dict) -> dict[str, float]:
    """Per role, the CPU the emulated processes spend themselves (device work asleep) on the calibration workload
    run isolated on the emulator, as the real isolated rounds ran it (the same jobs: the same units)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from emulated import EmulatedService, Job, Workload, policy

    meta = doc["meta"]
    wl = Workload("multitenant", [Job(name, {**spec, "hidden_dim": 128, "seed": len(name)}, meta["jobs"][name])
                                  for name, (spec, _) in meta["tenant_specs"].items()],
                  datapath={"envs_per_producer": meta["envs"]})
    svc = EmulatedService(wl, f"1-1-{meta['n_sim']}", OUT.stem, 1.0, "isolated")
    try:
        cpu0 = role_cpu(svc.nx.service.cpu_seconds())
        svc.run(policy("isolated"))
        return {k: v - cpu0[k] for k, v in role_cpu(svc.nx.service.cpu_seconds()).items()}
    finally:
        svc.close()


def write(doc: dict, mode: str, out: Path, which: str, host: dict[str, float] | None = None) -> None:
    """One calibration from the runs of ``mode``."""
    meta = doc["meta"]
    specs, jobs = meta["tenant_specs"], meta["jobs"]
    iso = [rd[mode]["service_times"] for rd in doc["rounds"]]
    k = meta["envs"]
    ratio = call_row_ratio("oft")

    def med(tenant: str, f) -> float:
        return statistics.median(f(st[tenant]) for st in iso)

    env, forward, rl_x, rl_y = {}, {}, [], []
    sft_step = None
    for name, (spec, kind) in specs.items():
        if kind == "sft":
            sft_step = med(name, lambda s: s["metering_s"]["actor"] / max(s["result"]["steps"], 1))
            continue
        e = spec["env"]
        req = med(name, lambda s: s["result"]["requests"])
        waves = med(name, lambda s: s["result"]["episodes"]) / k  # K envs in lockstep: one request per step
        env[e] = {"step_s": med(name, lambda s: s["simulator_split_s"]["sim_s"] / max(s["result"]["requests"], 1)),
                  "env_s": 0.0, "chunk": 1, "episode_steps": round(req / waves)}
        g = med(name, lambda s: s["metering_s"]["inference"] / max(s["result"]["requests"], 1))
        row = g / (ratio + k)
        forward[e] = {"call_s": ratio * row, "row_s": row}
        updates = med(name, lambda s: s["result"]["updates"])
        rows = med(name, lambda s: s["result"]["env_steps"]) / updates * jobs[name]["ppo"]["update_epochs"]
        rl_x.append(rows)
        rl_y.append(med(name, lambda s: s["metering_s"]["actor"] / s["result"]["updates"]))
        print(f"{mode} {name}: {req:.0f} requests, step {env[e]['step_s'] * 1000:.1f} ms, forward of {k} rows "
              f"{g * 1000:.1f} ms, update {rl_y[-1]:.2f} s over {rows:.0f} row-epochs")
    a, b = fit_line(rl_x, rl_y)
    bs = [32]
    lines = [
        "# Service times of this 2-core CPU box, from the real small-scale run (written by",
        "# experiments/paper_scale/calibrate.py; experiments/paper_scale/validate.py checks what it predicts).",
        f'source = """{SOURCE.relative_to(ROOT)} ({meta["command"]}): {which} metered actor,',
        "inference and simulator seconds and simulator stepping time per tenant, with their job results (medians of",
        f"{len(iso)} rounds); the forward's fixed : per-row split from {GROUPING.relative_to(ROOT)} (OFT, grouped",
        f'forwards, least squares: call / row = {ratio:.1f})."""',
        'description = "the tiny Qwen3-VL service on 2 shared CPU cores (experiments/multitenant)"',
        "dp_efficiency = 1.0",
        "sync_s = 0.0",
        *([] if host is None else [
            "", "[host]  # CPU per unit besides device work, the emulator's own subtracted (calibrate.py --host)",
            f"engine_request_s = {host['infer']:.6f}", f"sim_request_s = {host['sim']:.6f}",
            f"actor_item_s = {host['actor']:.6f}"]),
        "",
        "[forward.default]",
        f"call_s = {statistics.mean(f['call_s'] for f in forward.values()):.6f}",
        f"row_s = {statistics.mean(f['row_s'] for f in forward.values()):.6f}",
    ]
    for e, f in forward.items():
        lines += ["", f'[forward."{e}"]', f"call_s = {f['call_s']:.6f}", f"row_s = {f['row_s']:.6f}"]
    lines += ["", "[update.rl]", f"call_s = {a:.6f}", f"row_s = {b:.8f}",
              "", "[update.sft]", f"call_s = {sft_step:.6f}", "row_s = 0.0", f"# measured at batch {bs[0]}"]
    for e, c in env.items():
        lines += ["", f'[env."{e}"]', *(f"{key} = {v!r}" if isinstance(v, int) else f"{key} = {v:.6f}"
                                       for key, v in c.items())]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
