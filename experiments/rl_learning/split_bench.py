"""An on-policy RL batch in one rollout task vs split over two (``RLJob.split``), side by side.

One local service (``Nexus.local``, 2 simulator workers as by default), two tenants of the same spec
(``max_inflight=1``, one collector: each batch from the version it trains, as the demo's ``push-rl``), one with
``split=1`` and one with ``split=2``. Per round each runs an RL job of ``--updates`` updates of
``--episodes`` episodes (the order alternates between rounds); the figure is wall seconds per update and env
steps per second of each, and their ratio per round (split 2 / split 1), median over rounds.

    PYTHONPATH=$PWD .venv/bin/python experiments/rl_learning/split_bench.py --rounds 2     # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="maniskill/pushcube-state")
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--episodes", type=int, default=16, help="episodes per batch")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(HERE / "split_bench.json"))
    args = p.parse_args()

    import torch

    from nexus.client.api import Nexus
    from nexus.spec import TenantSpec

    torch.set_num_threads(1)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="nexus-split-") as root, Nexus.local(root) as nx:
        tenants = {k: nx.create_tenant(TenantSpec(name=f"split{k}", env=args.env, max_inflight=1, seed=1))
                   for k in (1, 2)}
        for r in range(args.rounds):
            row: dict = {"round": r, "load": os.getloadavg()[0]}
            for k in ((1, 2) if r % 2 == 0 else (2, 1)):
                t0 = time.perf_counter()
                res = tenants[k].rl(updates=args.updates, episodes_per_batch=args.episodes, collectors=1,
                                    split=k).result(timeout=3600)
                wall = time.perf_counter() - t0
                row[f"split{k}_s_per_update"] = wall / res["updates"]
                row[f"split{k}_env_steps_per_s"] = res["env_steps"] / wall
                row[f"split{k}_sim_s"] = res.get("sim_s", 0.0)
            row["speedup"] = row["split1_s_per_update"] / row["split2_s_per_update"]
            rows.append(row)
            print(f"round {r}: split 1 {row['split1_s_per_update']:.1f} s/update, split 2 "
                  f"{row['split2_s_per_update']:.1f} s/update -> {row['speedup']:.2f}x", flush=True)

    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "round"}
    print(f"\n| {args.updates} updates x {args.episodes} episodes, {args.env} | split 1 | split 2 |\n|---|---:|---:|")
    print(f"| wall s per update (median of {args.rounds}) | {med['split1_s_per_update']:.1f} | "
          f"{med['split2_s_per_update']:.1f} |")
    print(f"| env steps per s | {med['split1_env_steps_per_s']:.0f} | {med['split2_env_steps_per_s']:.0f} |")
    per_round = ", ".join(f"{r['speedup']:.2f}x" for r in rows)
    print(f"| speed-up, per round: {per_round} | | **{med['speedup']:.2f}x** |")
    doc = {"settings": vars(args), "rows": rows, "median": med,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "time": time.time()}
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
