"""CPU the MLflow tracking of a busy service costs: the control plane's tracker link and the tracker host
(``nexus.control.monitoring.tracking_link.TrackerLink`` → ``nexus.worker.plugin.TrackerHost``, a real
sqlite MLflow store) fed the metric rows of a 1 SFT + 3 RL workload at a fixed rate, with the link
sending at once (``linger_s = 0``: every call its own message and store write when the tracker keeps up,
as before batching) vs letting calls gather, side by side in one run, settings alternating over rounds.

In one process: the link's messages go straight to the host, so the Dask message each send costs in the
service (pickling on the scheduler and the worker) is not counted here; the figures are the tracker's
own work.

    python experiments/overhead/bench.py tracking        # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOBS = {"sft-a": "sft", "rl-b": "rl", "rl-c": "rl", "rl-d": "rl"}
SFT_ROW = {"loss": 0.5, "grad_norm": 1.2, "lr": 1e-3, "optimizer_steps": 1.0, "weight_sync_s": 0.0,
           "update_s": 0.05, "samples": 32.0}  # the fields of an SFT step's train row
RL_ROW = {"return": 1.0, "success_rate": 0.5, "episodes": 8.0, "env_steps": 256.0, "sim_s": 1.0,
          "action_wait_s": 0.5, "version": 3.0}  # a rollout row


async def stream(linger_s: float, args) -> dict[str, float]:
    from nexus.control.monitoring.tracking_link import TrackerLink
    from nexus.tracking.host import TrackerHost

    host = TrackerHost({"root": str(Path(tempfile.mkdtemp(prefix="nexus-track-")) / "service")})
    sends: list[int] = []

    async def send(address: str, calls: list) -> list:
        sends.append(len(calls))
        return await host.run(calls)

    link = TrackerLink(send, linger_s=linger_s)
    link.start()
    link.attach("local")
    for job, kind in JOBS.items():
        link.start_run(job, job.split("-")[1], kind, {"lr": 1e-3})
    await link.flush(60)
    sends.clear()
    t0, c0 = time.perf_counter(), time.process_time()
    period = 1.0 / args.sft_rate
    n, step = 0, 0
    while (now := time.perf_counter() - t0) < args.seconds:
        step += 1
        link.log_metrics("sft-a", SFT_ROW, step, "train")
        n += 1
        if step % max(1, round(args.sft_rate / args.rl_rate)) == 0:  # each RL job: a rollout row and an update
            for job in ("rl-b", "rl-c", "rl-d"):
                link.log_metrics(job, RL_ROW, step * 256, "rollout")
                link.log_metrics(job, SFT_ROW, step, "train")
                n += 2
        await asyncio.sleep(max(0.0, step * period - now))
    await link.flush(120)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    await link.close()
    host._thread.shutdown()
    return {"calls": n, "calls_per_s": n / wall, "cpu_pct_of_core": 100 * cpu / wall, "cpu_ms_per_call": 1e3 * cpu / n,
            "sends": len(sends), "calls_per_send": n / max(1, len(sends))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0, help="s of metric rows per setting and round")
    ap.add_argument("--sft-rate", type=float, default=20.0, help="SFT steps per s (a train row each)")
    ap.add_argument("--rl-rate", type=float, default=1.0, help="rollout + update rows per s, each of 3 RL jobs")
    ap.add_argument("--lingers", default="0,0.5,1.0", help="the link's linger_s settings compared")
    ap.add_argument("--out", default=str(HERE / "results.json"))
    args = ap.parse_args()
    lingers = [float(x) for x in args.lingers.split(",")]
    runs: dict[float, list[dict[str, float]]] = {x: [] for x in lingers}
    for r in range(args.rounds):
        for x in (lingers if r % 2 == 0 else lingers[::-1]):
            runs[x].append(asyncio.run(stream(x, args)))
            m = runs[x][-1]
            print(f"round {r} linger {x:5.2f} s: {m['cpu_pct_of_core']:5.1f} % of a core, "
                  f"{m['calls_per_send']:6.1f} calls per send  load {os.getloadavg()[0]:.1f}", flush=True)
    keys = list(runs[lingers[0]][0])
    med = {x: {k: statistics.median(run[k] for run in rs) for k in keys} for x, rs in runs.items()}
    print(f"\nMLflow tracking of a 1 SFT + 3 RL stream ({med[lingers[0]]['calls_per_s']:.0f} calls/s), median of "
          f"{args.rounds} rounds of {args.seconds:.0f} s, {os.cpu_count()} cores")
    print(f"{'linger_s':>9s} {'% of a core':>12s} {'CPU ms/call':>12s} {'sends/s':>9s} {'calls/send':>11s}")
    for x, m in med.items():
        print(f"{x:9.2f} {m['cpu_pct_of_core']:12.1f} {m['cpu_ms_per_call']:12.2f} "
              f"{m['sends'] / args.seconds:9.1f} {m['calls_per_send']:11.1f}")
    base = med[lingers[0]]["cpu_pct_of_core"]
    for x in lingers[1:]:
        print(f"linger {x:g} s uses {base / max(med[x]['cpu_pct_of_core'], 1e-9):.1f}x less CPU than {lingers[0]:g} s")
    out = Path(args.out)  # one results file for the folder: this script's section of it
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc["tracking"] = {
        "meta": {**vars(args), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                 "command": "python experiments/overhead/bench.py tracking " + " ".join(sys.argv[1:])},
        "median": {str(x): m for x, m in med.items()}, "runs": {str(x): rs for x, rs in runs.items()}}
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
