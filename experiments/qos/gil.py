"""The engine's model thread and its worker's event loop share one GIL: how much each slows the other.

An inference engine runs its forwards in a model thread of the worker process whose event loop receives the
predict calls (Dask RPC: unpickling, the comm, the handlers). torch releases the GIL inside each op, but the
Python between ops — the heads' dispatch, preprocessing, bookkeeping — holds it, as does the loop's work.
This probe times ``InferenceEngine._forward`` of a 20-row group of 16 ``maniskill/pushcube-state`` tenants
(this checkout, prefix cache on) alone and while a second thread does what a busy event loop does (0.2 ms
of unpickling gathered predicts, then a 0.5 ms wait in ``select``, again and again), and the second thread's
wake-up delay after its wait alone and beside the forwards; for two GIL switch intervals (Python's 5 ms, 1 ms).

    python experiments/qos/gil.py --out experiments/qos/gil_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from forward import Child  # noqa: E402  (the same engine and groups as the forward micro-benchmark)


def pctl(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(1e3 * s[min(len(s) - 1, int(q * len(s)))], 3) if s else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    child = Child(cache=True)
    engine = child.engine
    payload = pickle.dumps([[g.tenant, g.obs, None, True, None, None, 1] for g in child.group("state", 17, 1)])
    group = child.group("state", args.rows, 2)
    engine._forward(group)

    def forwards() -> float:
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            engine._forward(group)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def loop(stop: threading.Event, delays: list[float]) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < 2e-4:
                pickle.loads(payload)
            s = time.perf_counter()
            time.sleep(5e-4)
            delays.append(time.perf_counter() - s - 5e-4)

    def with_loop(body) -> tuple[object, list[float]]:
        stop, delays = threading.Event(), []
        th = threading.Thread(target=loop, args=(stop, delays))
        th.start()
        try:
            return body(), delays
        finally:
            stop.set()
            th.join()

    rows = []
    for switch in (0.005, 0.001):
        sys.setswitchinterval(switch)
        alone = forwards()
        _, idle = with_loop(lambda: time.sleep(1.0))
        busy, beside = with_loop(forwards)
        rows.append({"switch_interval_ms": 1e3 * switch, "forward_alone_ms": round(1e3 * alone, 3),
                     "forward_beside_loop_ms": round(1e3 * busy, 3), "stretch": round(busy / alone, 2),
                     "loop_wakeup_alone_p50_ms": pctl(idle, 0.5), "loop_wakeup_alone_p99_ms": pctl(idle, 0.99),
                     "loop_wakeup_beside_forwards_p50_ms": pctl(beside, 0.5),
                     "loop_wakeup_beside_forwards_p99_ms": pctl(beside, 0.99)})
    print(f"{args.rows}-row forward of 16 tenants; load {os.getloadavg()}")
    print("| GIL switch interval | forward alone ms | beside a busy loop ms | stretch | loop wake-up p99 alone "
          "→ beside forwards ms |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['switch_interval_ms']:.0f} ms | {r['forward_alone_ms']} | {r['forward_beside_loop_ms']} | "
              f"{r['stretch']}x | {r['loop_wakeup_alone_p99_ms']} → {r['loop_wakeup_beside_forwards_p99_ms']} |")
    if args.out:
        args.out.write_text(json.dumps({"rows": args.rows, "reps": args.reps, "loadavg": os.getloadavg(),
                                        "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
