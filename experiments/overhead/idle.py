"""CPU an idle service costs: the embedded deployment with the service's Dask settings
(``nexus.config.service.DASK_DEFAULTS``) vs Dask's own defaults, side by side in one run.

One ``Nexus.local`` service (scheduler, 2 SIM workers, actor, inference engine, gateway, their nannies)
per setting and round, no tenant; after a settling pause, the CPU time (user + system) of every process
over a window, by role. The settings alternate over the rounds.

    python experiments/overhead/bench.py idle            # ~3 min on 2 cores
    python experiments/overhead/bench.py idle --each     # also Dask's defaults with one service setting each
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
DASK_OWN = {  # Dask's defaults for the settings DASK_DEFAULTS changes
    "distributed.worker.profile.enabled": True, "distributed.admin.tick.interval": "20ms",
    "distributed.admin.system-monitor.interval": "500ms", "distributed.worker.memory.monitor-interval": "100ms",
    "distributed.nanny.pre-spawn-environ": {"MALLOC_TRIM_THRESHOLD_": 65536},  # busy workers: malloc.py
}


def measure(dask_config: dict, args) -> dict[str, float]:
    from nexus.client.api import Nexus

    with Nexus.local(Path(tempfile.mkdtemp(prefix="nexus-idle-")) / "service", n_sim=args.n_sim,
                     cluster={"dask_config": dask_config}) as nx:
        time.sleep(args.settle)
        a = nx.service.cpu_seconds()
        time.sleep(args.window)
        b = nx.service.cpu_seconds()
    return {k: 100 * (v - a.get(k, 0.0)) / args.window for k, v in sorted(b.items())}  # % of one core


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--n-sim", type=int, default=2)
    ap.add_argument("--settle", type=float, default=10.0, help="s after start-up before measuring")
    ap.add_argument("--window", type=float, default=30.0, help="s measured")
    ap.add_argument("--each", action="store_true", help="also Dask's defaults with one service setting each")
    ap.add_argument("--out", default=str(HERE / "results.json"))
    args = ap.parse_args()
    from nexus.config.service import DASK_DEFAULTS

    settings = {"service": {}, "dask defaults": DASK_OWN}
    if args.each:
        settings |= {f"only {'.'.join(k.split('.')[-2:])}": {**DASK_OWN, k: v} for k, v in DASK_DEFAULTS.items()}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in settings}
    for r in range(args.rounds):
        for name in (list(settings) if r % 2 == 0 else list(settings)[::-1]):
            runs[name].append(measure(settings[name], args))
            print(f"round {r} {name:14s} {sum(runs[name][-1].values()):5.1f} % of a core  load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    roles = sorted({k for rs in runs.values() for run in rs for k in run})
    med = {n: {k: statistics.median(run.get(k, 0.0) for run in rs) for k in roles} for n, rs in runs.items()}
    print(f"\nidle service, CPU in % of one core (median of {args.rounds} rounds, {args.window:.0f} s windows, "
          f"{os.cpu_count()} cores)")
    print(f"{'':12s}" + "".join(f"{n:>30s}" for n in settings))
    for k in roles:
        print(f"{k:12s}" + "".join(f"{med[n][k]:>30.1f}" for n in settings))
    totals = {n: sum(m.values()) for n, m in med.items()}
    print(f"{'total':12s}" + "".join(f"{totals[n]:>30.1f}" for n in settings))
    print(f"ratio dask defaults / service settings: {totals['dask defaults'] / max(totals['service'], 1e-9):.1f}x")
    out = Path(args.out)  # one results file for the folder: this script's section of it
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc["idle_each" if args.each else "idle"] = {
        "meta": {**vars(args), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                 "command": "python experiments/overhead/bench.py idle " + " ".join(sys.argv[1:]),
                 "settings": settings},
        "median_pct_of_core": med, "totals": totals, "runs": runs}
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
